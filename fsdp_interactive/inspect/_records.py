"""Plain records that the rank-side probes return and the notebook side renders, and the
probes that return them (:data:`PROBES`).

Everything here is torch-free on purpose: these dataclasses cross the wire between the
ranks and the notebook kernel (pickled by the pool) and are rendered by the widgets and
the text fallbacks.  Numbers are Python ints/floats, shapes are tuples of ints, dtypes and
placements are strings.

The merge helpers combine the per-rank answers of one probe call (the list a pool's
``call`` returns, in rank order) into one picture.  They do no communication.

A probe is declared once, in :data:`PROBES`, beside the record it answers with: its
name (what ``fsdp_interactive.inspect`` exports), the module that defines it (imported on
the ranks when first called, so the kernel never imports torch for it) and how the
ranks' answers combine into the one the kernel shows. The package exports every declared
probe; ``RankModel.ask`` asks any of them on a pool's ranks; the notebook side renders an
answer by its record type (``notebook/render.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class ShardSlice:
    """The slice of one parameter that one rank holds.

    ``offset`` is where the slice starts in the full tensor (per dimension); ``numel`` counts
    real elements, ``padded_numel`` what the rank stores (FSDP pads every shard to the size
    of the first one so that all-gathers are even; equal to ``numel`` when nothing pads).
    ``flat`` False: the rank holds the block of ``local_shape`` at ``offset``; True: it
    holds ``numel`` consecutive elements of the flattened (row-major) parameter from
    ``offset`` on, stored 1-D (``local_shape == (numel,)``): torch FSDP1's flat shards.
    """

    rank: int
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    numel: int
    padded_numel: int
    flat: bool = False

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is laid out across the ranks.

    ``fqn`` is the clean name (as ``torch.distributed.checkpoint.state_dict`` names it,
    without wrapper levels). ``slices`` has one entry per global rank of the parameter's
    mesh (a plain tensor, not a DTensor, has one full slice per rank of the world: it is
    replicated); for torch FSDP1's flat shards (``placements`` with ``FlatShard()``, or
    ``Replicate()`` under NO_SHARD) each rank knows only its own slice, so ``layout()``
    gives that one and :func:`merge_layouts` the others. ``unit`` is the clean FQN of the
    FSDP unit (the module ``fully_shard`` was applied to, or a torch FSDP1 module) that
    manages the parameter, ``""`` for the root; ``None`` when no FSDP unit manages it.
    """

    fqn: str
    global_shape: tuple[int, ...]
    dtype: str
    element_size: int
    is_dtensor: bool
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    requires_grad: bool
    slices: tuple[ShardSlice, ...]
    unit: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the full (unsharded) parameter."""
        return self.numel * self.element_size

    def slice_of(self, rank: int) -> ShardSlice | None:
        """The slice of this parameter that ``rank`` holds, or ``None`` when it holds none."""
        for piece in self.slices:
            if piece.rank == rank:
                return piece
        return None


@dataclass(frozen=True)
class RankLayout:
    """What ``inspect.layout(model)`` returns on one rank.

    ``params`` describe every parameter (identical on every rank of the mesh); the byte
    totals are measured on this rank only: local parameter storage including padding,
    gradients, optimizer state (if an optimizer was given) and buffers.  ``params`` is
    empty on the ranks that were asked not to describe them (``layout(...,
    params_from_rank=0)``).  ``host`` is the name of the machine the rank runs on.
    ``own_slices`` holds, by FQN, this rank's slice of every parameter whose slices only
    their own ranks know (torch FSDP1's flat shards): :func:`merge_layouts` completes
    those parameters' ``slices`` from every rank's.
    """

    rank: int
    world_size: int
    params: tuple[ParamLayout, ...]
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    buffer_bytes: int
    host: str = ""
    own_slices: dict[str, ShardSlice] = field(default_factory=dict)


@dataclass(frozen=True)
class RankTotals:
    """One rank's memory totals (see :class:`RankLayout`) and the host it runs on."""

    rank: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    buffer_bytes: int
    host: str = ""

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.buffer_bytes


@dataclass(frozen=True)
class ModelLayout:
    """The merged layout of a model: parameters plus every rank's memory totals."""

    world_size: int
    params: tuple[ParamLayout, ...]
    ranks: tuple[RankTotals, ...]

    @property
    def model_bytes(self) -> int:
        """Bytes of all parameters, unsharded."""
        return sum(p.nbytes for p in self.params)

    def held_bytes(self, rank: int) -> int:
        """Bytes of real (unpadded) parameter elements the rank holds, from the slices."""
        total = 0
        for p in self.params:
            piece = p.slice_of(rank)
            if piece is not None:
                total += piece.numel * p.element_size
        return total

    def param(self, fqn: str) -> ParamLayout:
        """The layout of the parameter named ``fqn`` (its clean name); ``KeyError`` naming some
        known parameters when there is none."""
        for p in self.params:
            if p.fqn == fqn:
                return p
        known = ", ".join(p.fqn for p in self.params[:8])
        raise KeyError(f"no parameter {fqn!r}; known parameters include: {known}")


def merge_layouts(per_rank: list[RankLayout]) -> ModelLayout:
    """Combine the per-rank answers of ``layout(model)`` (any order) into a ModelLayout.

    The parameters come from the lowest rank that described them (every rank describes
    the same parameters; see ``layout(..., params_from_rank=)``). The slices of parameters
    only their own ranks know (``RankLayout.own_slices``) come from every rank's answer:
    ``ValueError`` naming the missing ranks when some rank's answer is not in ``per_rank``.
    """
    if not per_rank:
        raise ValueError("merge_layouts needs at least one RankLayout, got an empty list")
    ordered = sorted(per_rank, key=lambda r: r.rank)
    totals = tuple(
        RankTotals(r.rank, r.param_bytes, r.grad_bytes, r.optim_bytes, r.buffer_bytes, r.host)
        for r in ordered
    )
    params = next((r.params for r in ordered if r.params), ())
    if any(r.own_slices for r in ordered):
        params = tuple(_with_every_rank(p, ordered) for p in params)
    return ModelLayout(world_size=ordered[0].world_size, params=params, ranks=totals)


def _with_every_rank(param: ParamLayout, ordered: list[RankLayout]) -> ParamLayout:
    """``param`` with its slices from every rank's ``own_slices`` (itself when no rank
    reports its slice separately)."""
    slices = tuple(r.own_slices[param.fqn] for r in ordered if param.fqn in r.own_slices)
    if not slices:
        return param
    world_size = ordered[0].world_size
    if len(slices) != world_size:
        missing = sorted(set(range(world_size)) - {s.rank for s in slices})
        raise ValueError(
            f"the slices of {param.fqn!r} are known only to the ranks holding them; the "
            f"layouts of ranks {missing} are missing: merge the layouts of all "
            f"{world_size} ranks"
        )
    return replace(param, slices=slices)


NO_GRADIENTS = "no gradients yet: run a backward pass on the ranks first"
"""What a gradient-norm record or view says before the first backward."""


@dataclass(frozen=True)
class GradNorms:
    """Gradient norms of a model, the same on every rank.

    ``total`` is the global norm as ``torch.nn.utils.clip_grad_norm_`` computes it (the
    ``norm_type``-norm of the per-parameter norms; parameters without a gradient are left
    out).  ``params`` maps FQN -> norm of the full gradient; ``modules`` maps a module's FQN
    ("" is the root) -> the norm over all parameters below it.  ``nonfinite`` lists the
    parameters whose gradient holds a NaN or an Inf, with their counts.  ``units`` maps an
    FSDP unit's FQN ("" is the root unit) -> the norm over the parameters it manages, and
    ``unit_of`` a parameter's FQN -> its unit; both are empty when no ``fully_shard``
    manages the model's parameters.  Before the first backward no parameter has a
    gradient: ``params`` is empty, ``total`` is 0.0 (as ``clip_grad_norm_`` returns) and the
    record says "no gradients yet" when shown, as the views do (``has_gradients``: False).
    """

    norm_type: float
    total: float
    params: dict[str, float]
    modules: dict[str, float]
    nan_counts: dict[str, int] = field(default_factory=dict)
    inf_counts: dict[str, int] = field(default_factory=dict)
    units: dict[str, float] = field(default_factory=dict)
    unit_of: dict[str, str] = field(default_factory=dict)

    @property
    def has_gradients(self) -> bool:
        """Whether any parameter had a gradient (``False`` before the first backward)."""
        return bool(self.params)

    def __repr__(self) -> str:
        if not self.has_gradients:
            return f"GradNorms(norm_type={self.norm_type:g}, {NO_GRADIENTS})"
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"GradNorms({shown})"

    @property
    def nonfinite(self) -> list[str]:
        return sorted(set(self.nan_counts) | set(self.inf_counts))

    @property
    def has_nonfinite(self) -> bool:
        return bool(self.nan_counts or self.inf_counts) or not math.isfinite(self.total)


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one full (unsharded) tensor, or of all parameters of a module.

    ``hist_counts``/``hist_edges`` cover the finite values only (``len(edges) ==
    len(counts) + 1``); mean/std/min/max/norm are over finite values too, NaN when there are
    none.  ``names`` lists the parameters that were summarized.
    """

    fqn: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    numel: int
    mean: float
    std: float
    min: float
    max: float
    norm: float
    nan_count: int
    inf_count: int
    hist_counts: tuple[int, ...]
    hist_edges: tuple[float, ...]


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one rank: process RSS always; device figures when the rank uses CUDA."""

    rank: int
    host: str
    pid: int
    device: str
    rss_bytes: int
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    max_allocated_bytes: int | None = None
    device_total_bytes: int | None = None


@dataclass(frozen=True)
class GradNormRecord:
    """One step recorded by ``GradNormRecorder``."""

    step: int
    total: float
    modules: dict[str, float]
    nan_count: int
    inf_count: int

    @property
    def nonfinite(self) -> bool:
        return self.nan_count > 0 or self.inf_count > 0 or not math.isfinite(self.total)


def combine_norms(norms: list[float], norm_type: float) -> float:
    """The ``norm_type``-norm of several norms (0 for none; inf on overflow)."""
    if not norms:
        return 0.0
    if math.isinf(norm_type):
        return max(norms)
    try:
        return math.fsum(v**norm_type for v in norms) ** (1.0 / norm_type)
    except OverflowError:
        return math.inf


def find_spikes(values: list[float], factor: float = 3.0, window: int = 20) -> list[int]:
    """Indices whose value exceeds ``factor`` times the median of the ``window`` before it.

    Non-finite values are never spikes (they are reported separately); the first value has
    no history and is never a spike.
    """
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    spikes: list[int] = []
    for i, value in enumerate(values):
        history = [v for v in values[max(0, i - window) : i] if math.isfinite(v)]
        if not history or not math.isfinite(value):
            continue
        history.sort()
        median = history[len(history) // 2]
        if median > 0 and value > factor * median:
            spikes.append(i)
    return spikes


def record_to_json(record: GradNormRecord) -> dict[str, Any]:
    """``record`` as a JSON-ready dict (NaN and infinities as strings); :func:`record_from_json`
    reads it back."""

    def num(value: float) -> float | str:
        return value if math.isfinite(value) else str(value)

    return {
        "step": record.step,
        "total": num(record.total),
        "modules": {k: num(v) for k, v in record.modules.items()},
        "nan_count": record.nan_count,
        "inf_count": record.inf_count,
    }


def record_from_json(line: str) -> GradNormRecord:
    """Parse one line written by a recorder's ``log_path`` back into a record."""
    data = json.loads(line)
    return GradNormRecord(
        step=int(data["step"]),
        total=float(data["total"]),
        modules={k: float(v) for k, v in data.get("modules", {}).items()},
        nan_count=int(data.get("nan_count", 0)),
        inf_count=int(data.get("inf_count", 0)),
    )


def rank0_answer(answers: Sequence[Any]) -> Any:
    """The answer of a probe every rank answers alike (a collective's result): rank 0's."""
    return answers[0]


def by_rank(answers: Sequence[Any]) -> list[Any]:
    """The answers of a probe every rank answers for itself (records with a ``rank``
    field), in rank order."""
    return sorted(answers, key=lambda answer: answer.rank)


@dataclass(frozen=True)
class Probe:
    """A probe as the kernel asks for it on the ranks.

    ``fsdp_interactive.inspect.<name>``, defined in ``module`` (imported on the ranks when
    first called), runs on every rank and answers there with a ``record``; ``combine``
    makes the ranks' answers (in rank order) the one answer the kernel shows;
    ``on_model``: its first argument is the model.
    """

    name: str
    module: str
    record: type
    combine: Callable[[Sequence[Any]], Any]
    on_model: bool = True


def _declare(*probes: Probe) -> dict[str, Probe]:
    return {probe.name: probe for probe in probes}


_INSPECT = "fsdp_interactive.inspect"

#: Every probe, by name: the one place a probe is declared (see the module docstring).
PROBES = _declare(
    Probe("layout", f"{_INSPECT}._layout", RankLayout, merge_layouts),
    Probe("grad_norms", f"{_INSPECT}._grad_norms", GradNorms, rank0_answer),
    Probe("summon_stats", f"{_INSPECT}._summon_stats", TensorStats, rank0_answer),
    Probe("edit_param", f"{_INSPECT}._summon_stats", TensorStats, rank0_answer),
    Probe("memory", f"{_INSPECT}._memory", MemoryStats, by_rank, on_model=False),
)
