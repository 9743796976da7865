"""One FSDP1 test body, run with torch's ``FullyShardedDataParallel`` and with this package's.

A *check* is a module-level function ``check(fsdp: Flavor) -> value`` written against FSDP1's
public API only: it builds its model with ``fsdp.wrap(module, **kwargs)`` (or
``fsdp.cls``'s static methods) and returns plain data (numbers, strings, tensors, and
lists, tuples and dicts of them). :func:`side_by_side` runs every check of a list on a rank,
first with torch's class (``device_id=torch.device("cpu")``, which torch's FSDP1 needs on
CPU ranks), then with this package's, and records for each an :class:`Outcome`: the value,
or the exception's type and message, and the warnings raised. Every rank runs the same
checks in the same order, so the collectives inside them pair up.

On the test side, :func:`assert_conforms` compares the two outcomes of a check: the same
exception type (or none), the same warning categories, and values equal bit for bit
(:func:`assert_same`); tests that expect a difference by design check each flavor on its
own and say why.

Only rank 0's outcomes are compared unless a test asks for every rank's.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

TORCH = "torch"
OURS = "ours"

# Warnings only this package's engine raises, about what every fully_shard user meets: they
# carry no FSDP1 meaning, so comparisons of warning categories leave them out.
ENGINE_WARNINGS = {
    # fully_shard (torch 2.13+) warns when a unit's output is a view (F.linear on 3-D
    # inputs returns one): an in-place op on it would skip the unit's pre-backward hook.
    # torch's FSDP1 registers its hooks differently and has no such caution.
    "returned a view tensor": "fully_shard's caution about in-place ops on view outputs",
}

# Deprecations torch's FSDP1 announces for its own implementation, which this package keeps
# as its supported API (README, FSDP1 compatibility): comparisons leave them out too.
FSDP1_DEPRECATIONS = {
    # FSDP1's NO_SHARD is deprecated in favour of DDP; here NO_SHARD is fully_shard on a
    # (world, 1) mesh and stays supported.
    "The `NO_SHARD` sharding strategy is deprecated": "NO_SHARD is supported here",
    # state_dict_type / set_state_dict_type point to DCP's get/set_state_dict; here they
    # are the supported way to choose a state-dict format.
    "FSDP.set_state_dict_type() are being deprecated": (
        "FSDP1's state-dict types are supported here"
    ),
}
# Warnings torch's FSDP1 raises about its own internals, which this package does not use.
FSDP1_INTERNALS = {
    # FSDP1's sharded state dicts hold ShardedTensor, which torch deprecates for DTensor;
    # this package's hold DTensor.
    "we are deprecating ShardedTensor": "sharded values are DTensors here",
    # FSDP1's ShardedTensor values call a deprecated helper of torch's c10d, which also
    # warns that it guesses the group's device.
    "`_get_pg_default_device` will be deprecated": "a helper only ShardedTensor uses",
    "Multiple backends are registered with this ProcessGroup": "the same helper's guess",
    # torch 2.9 warns while freeing tensors of FSDP1's own objects, whenever garbage
    # collection runs (so during whichever check runs next); runs of this package's class
    # alone do not raise it.
    "Deallocating Tensor that still has live PyObject references": "FSDP1's garbage",
}
IGNORED_WARNINGS = {**ENGINE_WARNINGS, **FSDP1_DEPRECATIONS, **FSDP1_INTERNALS}


@dataclass(frozen=True)
class Flavor:
    """Which ``FullyShardedDataParallel`` a check runs with, and how it is constructed."""

    name: str
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)

    def wrap(self, module: torch.nn.Module, **kwargs: Any) -> Any:
        """``cls(module, **kwargs)``, plus what this flavor needs on CPU ranks."""
        return self.cls(module, **{**self.kwargs, **kwargs})

    @property
    def torch(self) -> bool:
        return self.name == TORCH


def flavors() -> tuple[Flavor, Flavor]:
    """torch's FSDP1 (with ``device_id=torch.device("cpu")``) and this package's class."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from fsdp_interactive.fsdp import FullyShardedDataParallel

    return (
        Flavor(TORCH, TorchFSDP, {"device_id": torch.device("cpu")}),
        Flavor(OURS, FullyShardedDataParallel),
    )


@dataclass
class Outcome:
    """What running a check did: its value, or the exception it raised, and its warnings."""

    value: Any = None
    error: str | None = None
    message: str = ""
    trace: str = ""
    warnings: list[tuple[str, str]] = field(default_factory=list)

    @property
    def categories(self) -> list[str]:
        """Warning categories, without :data:`IGNORED_WARNINGS`, sorted and deduplicated."""
        return sorted(
            {
                category
                for category, message in self.warnings
                if not any(key in message for key in IGNORED_WARNINGS)
            }
        )

    def warned(self, pattern: str) -> list[str]:
        """``"Category: message"`` of every warning whose message matches ``pattern``."""
        return [f"{c}: {m}" for c, m in self.warnings if re.search(pattern, m)]

    def describe(self) -> str:
        if self.error is not None:
            return f"raised {self.error}: {self.message}\n{self.trace}"
        return f"returned {self.value!r:.300}"


def observe(fn: Callable[[], Any]) -> Outcome:
    """Run ``fn`` recording every warning; the outcome (exceptions are caught)."""
    from fsdp_interactive.fsdp import _config

    _config._warned.clear()  # this package warns once per process; each check starts fresh
    outcome = Outcome()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcome.value = fn()
        except Exception as exc:
            outcome.error = type(exc).__name__
            outcome.message = str(exc)
            outcome.trace = traceback.format_exc(limit=-4)
    outcome.warnings = [(w.category.__name__, str(w.message)) for w in caught]
    return outcome


Check = Callable[[Flavor], Any]


def side_by_side(checks: Sequence[Check]) -> dict[str, dict[str, Outcome]]:
    """``{check name: {"torch": outcome, "ours": outcome}}`` (collective: every rank runs
    every check, torch's flavor first)."""
    results: dict[str, dict[str, Outcome]] = {}
    for check in checks:
        results[check.__name__] = {
            flavor.name: observe(lambda check=check, flavor=flavor: check(flavor))
            for flavor in flavors()
        }
    return results


class RankResults:
    """The outcomes of one list of checks on every rank of a group, computed once per
    group and shared by the tests that read them."""

    _cache: dict[tuple[str, int], Any] = {}

    def __init__(self, per_rank: list[dict[str, dict[str, Outcome]]]):
        self.per_rank = per_rank

    @classmethod
    def of(cls, ranks: Any, rank_fn: Callable[[], dict]) -> RankResults:
        """``rank_fn`` run on ``ranks`` (a ``tests.multirank.RankGroup``) once; a failure
        is kept and raised again to every test that asks."""
        key = (f"{rank_fn.__module__}.{rank_fn.__qualname__}", ranks.world_size)
        if key not in cls._cache:
            try:
                cls._cache[key] = cls(ranks.run(rank_fn))
            except Exception as exc:
                cls._cache[key] = exc
        found = cls._cache[key]
        if isinstance(found, Exception):
            raise found
        return found

    def __getitem__(self, check: str | Check) -> dict[str, Outcome]:
        """Rank 0's outcomes of ``check``."""
        return self.on(0, check)

    def on(self, rank: int, check: str | Check) -> dict[str, Outcome]:
        name = check if isinstance(check, str) else check.__name__
        return self.per_rank[rank][name]

    def every_rank(self, check: str | Check) -> list[dict[str, Outcome]]:
        return [self.on(rank, check) for rank in range(len(self.per_rank))]


def value(outcome: Outcome) -> Any:
    """The outcome's value; fails the test, with the exception, if it raised."""
    assert outcome.error is None, outcome.describe()
    return outcome.value


def assert_same(theirs: Any, ours: Any, path: str = "value") -> None:
    """``theirs == ours`` bit for bit: tensors of the same dtype and shape with equal
    elements (NaNs equal), the same keys, lengths and plain values."""
    _compare(theirs, ours, path, _equal_tensors)


def assert_close(theirs: Any, ours: Any, *, rtol: float, atol: float, path: str = "value") -> None:
    """:func:`assert_same`, with tensors equal within ``rtol`` / ``atol`` only (for results
    whose rounding depends on how the parameters are partitioned, said where used)."""

    def close(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")

    _compare(theirs, ours, path, close)


def _equal_tensors(theirs: torch.Tensor, ours: torch.Tensor, path: str) -> None:
    assert theirs.dtype == ours.dtype, f"{path}: dtype {theirs.dtype} vs {ours.dtype}"
    assert theirs.shape == ours.shape, f"{path}: shape {theirs.shape} vs {ours.shape}"
    assert torch.equal(theirs, ours) or torch.equal(theirs.nan_to_num(), ours.nan_to_num()), (
        f"{path}: max difference {(theirs.double() - ours.double()).abs().max().item():.3e}"
    )


def _compare(
    theirs: Any, ours: Any, path: str, tensors: Callable[[torch.Tensor, torch.Tensor, str], None]
) -> None:
    if isinstance(theirs, torch.Tensor) or isinstance(ours, torch.Tensor):
        assert isinstance(theirs, torch.Tensor) and isinstance(ours, torch.Tensor), (
            f"{path}: {type(theirs).__name__} vs {type(ours).__name__}"
        )
        tensors(theirs, ours, path)
        return
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), f"{path}: dict vs {type(ours).__name__}"
        assert list(theirs) == list(ours), f"{path}: keys {list(theirs)} vs {list(ours)}"
        for key in theirs:
            _compare(theirs[key], ours[key], f"{path}[{key!r}]", tensors)
        return
    if isinstance(theirs, list | tuple):
        assert isinstance(ours, list | tuple), f"{path}: sequence vs {type(ours).__name__}"
        assert len(theirs) == len(ours), f"{path}: length {len(theirs)} vs {len(ours)}"
        for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            _compare(a, b, f"{path}[{i}]", tensors)
        return
    assert theirs == ours, f"{path}: {theirs!r} vs {ours!r}"


def assert_conforms(
    outcomes: dict[str, Outcome],
    *,
    values: bool = True,
    fails: bool = False,
    words: str | None = None,
    warns: str | None = None,
) -> None:
    """torch's and our outcome of one check agree: both returned (or, with ``fails`` or
    ``words``, both raised the same exception type), with the same warning categories and,
    with ``values``, the same value bit for bit. ``words``: a regular expression both
    exception messages match (the words FSDP1's own tests match). ``warns``: a regular
    expression that some warning of each flavor matches."""
    theirs, ours = outcomes[TORCH], outcomes[OURS]
    expect_error = fails or words is not None
    for flavor, outcome in outcomes.items():
        assert (outcome.error is not None) == expect_error, f"{flavor} {outcome.describe()}" + (
            "" if expect_error else "\n(expected a value)"
        )
    assert theirs.error == ours.error, f"torch {theirs.describe()}\n-- ours {ours.describe()}"
    if words is not None:
        for flavor, outcome in outcomes.items():
            assert re.search(words, outcome.message), f"{flavor}: {outcome.message}"
    assert theirs.categories == ours.categories, (
        f"warning categories: torch {theirs.warnings} -- ours {ours.warnings}"
    )
    if warns is not None:
        for flavor, outcome in outcomes.items():
            assert outcome.warned(warns), f"{flavor} did not warn /{warns}/: {outcome.warnings}"
    if values and not expect_error:
        assert_same(theirs.value, ours.value)


def assert_reduced_alike(
    outcomes: dict[str, Outcome], world: int, *, low_precision: bool = False
) -> None:
    """:func:`assert_conforms` for values computed from reduced gradients: bit for bit on 2
    ranks, where every reduced element is the sum of two numbers (the same in either
    order). On more ranks a reduce-scatter adds an element's contributions in an order that
    depends on where the element sits in the reduced buffer (FSDP1: one flat buffer per
    unit; here per-parameter dim-0 chunks), so values agree to rounding: of float32, or of
    the reduced dtype under mixed precision (``low_precision``)."""
    if world == 2:
        assert_conforms(outcomes)
        return
    assert_conforms(outcomes, values=False)
    rtol, atol = (1e-2, 1e-3) if low_precision else (1e-5, 1e-6)
    assert_close(value(outcomes[TORCH]), value(outcomes[OURS]), rtol=rtol, atol=atol)


def assert_all_conform(results: RankResults, checks: Iterable[Check], **kwargs: Any) -> None:
    """:func:`assert_conforms` for every check of ``checks``; every mismatch reported."""
    failures = []
    for check in checks:
        try:
            assert_conforms(results[check], **kwargs)
        except AssertionError as exc:
            failures.append(f"{check.__name__}: {exc}")
    assert not failures, "\n\n".join(failures)
