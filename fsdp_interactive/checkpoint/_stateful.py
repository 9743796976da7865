"""Training state besides model and optimizer: LR schedulers, samplers, RNG snapshots.

Any object with ``state_dict()`` and ``load_state_dict(state)`` is *Stateful* (DCP's
definition). Two kinds, told apart by one method:

* **global** (the default, e.g. an LR scheduler): the same state on every rank. Saved
  once; on load every rank gets it, whatever the world size. At save time every rank
  compares a SHA-256 of its serialized state with the others'; if they disagree the
  save raises ``ValueError`` naming the ranks before anything is written.
* **per rank** (:class:`PerRankStateful`: it also has ``reshard_state``, e.g.
  :class:`~fsdp_interactive.checkpoint.RNGState`,
  :class:`~fsdp_interactive.checkpoint.ResumableDistributedSampler`): every rank's state
  is saved. On load at the saved world size rank ``r`` gets what rank ``r`` saved. At
  another world size every rank reads all saved states and gets
  ``obj.reshard_state(saved_states, rank, world_size)``: the object defines the rule.

Storage: each state is ``torch.save``-d into a uint8 tensor, one DCP item per state (per
rank for per-rank states), under ``stateful.<name>`` / ``stateful_per_rank.<name>.<rank>``,
and read back with ``torch.load(weights_only=True)``. Plain Python data and tensors
round-trip exactly (integer keys and empty containers included, which DCP's own
flattening would change); tensors come back on CPU; anything ``weights_only`` refuses is
refused at save time. Not supported: sharded tensors (DTensor) inside such a state.

The objects are not handed to DCP as Stateful values because DCP would call
``load_state_dict`` in the middle of a load, before the remaining checks have passed.
"""

from __future__ import annotations

import copy
import hashlib
import io
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint._format._safe_reader import section_paths
from fsdp_interactive.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from fsdp_interactive.fsdp._fqn_state import map_tensors

logger = logging.getLogger(__name__)

GLOBAL = "global"
PER_RANK = "per_rank"
SECTIONS = {GLOBAL: "stateful", PER_RANK: "stateful_per_rank"}


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a checkpoint saves and restores."""

    def state_dict(self) -> dict[str, Any]:
        """The object's state, to be saved."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state a ``state_dict()`` call returned."""


@runtime_checkable
class PerRankStateful(Stateful, Protocol):
    """A Stateful whose state differs per rank, and how to spread it over a new world.

    ``reshard_state(saved, rank, world_size)`` gets the states saved by ranks
    ``0..len(saved)-1`` (in rank order) and returns the state rank ``rank`` of a world of
    ``world_size`` ranks loads. It is called only when the world size changed, on every
    rank, and must be deterministic.
    """

    def reshard_state(
        self, saved: Sequence[dict[str, Any]], rank: int, world_size: int
    ) -> dict[str, Any]:
        """The state that rank ``rank`` of a world of ``world_size`` ranks loads, from the states
        ranks ``0..len(saved)-1`` saved."""


def kind_of(obj: Stateful) -> str:
    return PER_RANK if isinstance(obj, PerRankStateful) else GLOBAL


def check_stateful(stateful: Mapping[str, Any] | None) -> dict[str, Stateful]:
    """The ``stateful`` argument, validated: names are non-empty strings without ".",
    values have callable ``state_dict`` and ``load_state_dict``."""
    if stateful is None:
        return {}
    if not isinstance(stateful, Mapping):
        raise TypeError(
            "stateful must be a mapping of names to objects with state_dict() and "
            f"load_state_dict(), got {type(stateful).__name__}"
        )
    for name, obj in stateful.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"stateful names must be non-empty strings without '.', got {name!r}")
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"stateful[{name!r}] must have state_dict() and load_state_dict(), "
                f"got {type(obj).__name__}"
            )
    return dict(stateful)


def pack(state: Any, where: str) -> torch.Tensor:
    """``state`` as a uint8 tensor; ``ValueError`` naming ``where`` if it is not plain data."""
    buffer = io.BytesIO()
    torch.save(map_tensors(state, lambda t: t.detach().cpu()), buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"{where}.state_dict() holds data a checkpoint cannot restore safely "
            f"(only plain Python data and tensors are kept): {exc}"
        ) from exc
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unpack(packed: torch.Tensor, where: str) -> Any:
    try:
        return torch.load(io.BytesIO(packed.numpy().tobytes()), weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(f"checkpoint item {where} is not plain data ({exc})") from exc


def capture(objects: Mapping[str, Stateful], ranks: Ranks) -> tuple[dict[str, Any], dict[str, str]]:
    """The DCP sections holding this rank's share of ``objects``, and each name's kind.

    Collective when a global object is present (its digest is compared across ranks).
    """
    sections: dict[str, dict[str, Any]] = {GLOBAL: {}, PER_RANK: {}}
    kinds: dict[str, str] = {}
    digests: dict[str, str] = {}
    for name, obj in objects.items():
        kind = kinds[name] = kind_of(obj)
        packed = pack(copy.deepcopy(obj.state_dict()), f"stateful[{name!r}]")
        if kind == GLOBAL:
            sections[GLOBAL][name] = packed
            digests[name] = hashlib.sha256(packed.numpy().tobytes()).hexdigest()
        else:
            sections[PER_RANK][name] = {str(ranks.rank): packed}
    if digests:
        everyone = ranks.all_gather(digests)
        for name in digests:
            differ = [r for r, theirs in enumerate(everyone) if theirs[name] != everyone[0][name]]
            if differ:
                raise ValueError(
                    f"stateful[{name!r}] has another state on rank(s) {differ} than on "
                    "rank 0: a state saved once must be the same on every rank; "
                    "an object whose state differs per rank needs a reshard_state method "
                    "(see fsdp_interactive.checkpoint.PerRankStateful)"
                )
    logger.debug(
        "rank %d captured stateful %s (%d bytes)",
        ranks.rank,
        kinds,
        sum(t.numel() for t in sections[GLOBAL].values())
        + sum(t.numel() for per in sections[PER_RANK].values() for t in per.values()),
    )
    return {SECTIONS[k]: v for k, v in sections.items() if v}, kinds


def _packed_sizes(metadata: Metadata) -> dict[tuple, int]:
    """Object path -> byte count of every packed Stateful item in the checkpoint."""
    sizes = {}
    for section in SECTIONS.values():
        for key, path in section_paths(metadata, section).items():
            entry = metadata.state_dict_metadata[key]
            if isinstance(entry, TensorStorageMetadata) and len(entry.size) == 1:
                sizes[path] = int(entry.size[0])
    return sizes


def load_targets(
    objects: Mapping[str, Stateful],
    saved_kinds: Mapping[str, str],
    metadata: Metadata,
    *,
    saved_world_size: int,
    ranks: Ranks,
    strict: bool,
) -> tuple[dict[str, Any], list[str]]:
    """Buffers for the saved states ``objects`` need, and the names the checkpoint lacks.

    A per-rank object reads every saved rank's state when the world size changed, else
    only its own rank's.
    """
    sizes = _packed_sizes(metadata)
    target: dict[str, dict[str, Any]] = {}
    missing = []
    for name, obj in objects.items():
        saved_kind = saved_kinds.get(name)
        if saved_kind is None:
            missing.append(f"stateful:{name}")
            continue
        if saved_kind != kind_of(obj):
            raise IncompatibleCheckpointError(
                f"stateful[{name!r}] is {kind_of(obj).replace('_', '-')} here but was saved "
                f"{saved_kind.replace('_', '-')}; load it into an object of the same kind"
            )
        section = SECTIONS[saved_kind]
        if saved_kind == GLOBAL:
            paths = [(section, name)]
        elif saved_world_size == ranks.size:
            paths = [(section, name, str(ranks.rank))]
        else:
            paths = [(section, name, str(r)) for r in range(saved_world_size)]
        for path in paths:
            if path not in sizes:
                raise CorruptCheckpointError(
                    f"checkpoint lists stateful[{name!r}] but holds no item {'.'.join(path)}"
                )
            node = target.setdefault(path[0], {})
            for key in path[1:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = torch.empty(sizes[path], dtype=torch.uint8)
    if missing and strict:
        raise IncompatibleCheckpointError(
            f"checkpoint holds no state for {missing}; saved: {sorted(saved_kinds)}; "
            "pass strict=False to load the rest",
            missing_keys=missing,
        )
    return target, missing


def states_to_apply(
    objects: Mapping[str, Stateful],
    loaded: Mapping[str, Any],
    *,
    saved_world_size: int,
    ranks: Ranks,
) -> dict[str, Any]:
    """Name -> the state this rank's object loads (resharded where the world changed)."""
    states = {}
    for name, obj in objects.items():
        if name in loaded.get(SECTIONS[GLOBAL], {}):
            states[name] = unpack(loaded[SECTIONS[GLOBAL]][name], f"stateful.{name}")
            continue
        per_rank = loaded.get(SECTIONS[PER_RANK], {}).get(name)
        if per_rank is None:
            continue
        if saved_world_size == ranks.size:
            key = str(ranks.rank)
            states[name] = unpack(per_rank[key], f"stateful_per_rank.{name}.{key}")
            continue
        saved = [
            unpack(per_rank[str(r)], f"stateful_per_rank.{name}.{r}")
            for r in range(saved_world_size)
        ]
        try:
            states[name] = obj.reshard_state(saved, ranks.rank, ranks.size)  # type: ignore[attr-defined]
        except Exception as exc:
            raise CheckpointError(
                f"stateful[{name!r}].reshard_state from {saved_world_size} to {ranks.size} "
                f"ranks failed: {type(exc).__name__}: {exc}"
            ) from exc
        logger.info(
            "stateful %r: rank %d resharded from %d saved ranks to %d",
            name,
            ranks.rank,
            saved_world_size,
            ranks.size,
        )
    return states
