"""Statistics of tensors that may be sharded, computed where the data is (rank side).

Each rank reduces the piece of each tensor it holds to a few float64 numbers; only those
numbers travel, gathered over the groups whose ranks hold different pieces.  Two rounds:

1. per piece: finite count, NaN count, Inf count, finite sum, finite sum of squares,
   finite min and max  ->  the global mean and range;
2. per piece: the sum of squared deviations from the global mean and a histogram over the
   global range  ->  the standard deviation and the histogram.

This is the textbook two-pass variance, and every element lands in the same histogram
bin as ``torch.histc`` over the whole tensor puts it (the same float64 value against the
same range), so the results equal those of the gathered full tensor up to float64
rounding of the sums.  No tensor is gathered, and no piece is converted to float64 whole:
a chunk at a time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_interactive.inspect._records import TensorStats
from fsdp_interactive.wrapping import OriginalParam

logger = logging.getLogger(__name__)

# Elements converted to float64 at a time: 8 MiB of working memory whatever the shard's
# size, and fresh pages are not faulted in for a full float64 copy of every piece.
_CHUNK = 1 << 20

# Columns of the first round's row.
_FINITE, _NAN, _INF, _SUM, _SQUARES, _MIN, _MAX = range(7)


@dataclass
class Part:
    """What this rank holds of one tensor, and where the other parts are.

    ``groups``: the process groups along which the tensor is split (the ranks of such a
    group hold different parts; ranks that hold the same part are in none of them); empty
    for a tensor this rank holds whole. ``comm_device``: where the collectives' tensors must
    live (:func:`fsdp_interactive.fsdp._comm_device.comm_device`: CUDA under NCCL even when
    the part itself is offloaded to the CPU).
    """

    values: torch.Tensor
    groups: tuple[dist.ProcessGroup, ...]
    comm_device: torch.device
    # Indices of the chunks that hold NaN or Inf (found by the first round).
    nonfinite_chunks: set[int] = field(default_factory=set)


def part_of(param: OriginalParam) -> Part:
    """This rank's :class:`Part` of ``param`` (its piece, flattened: element order does not
    matter to the statistics)."""
    values = param.piece().values.reshape(-1)
    return Part(
        values, param.split_groups, param.comm_device if param.split_groups else values.device
    )


def tensor_stats(fqn: str, params: Sequence[OriginalParam], bins: int) -> TensorStats:
    """Statistics of ``params`` taken together (a single parameter keeps its shape).

    A collective over the groups that split them (every rank of those groups must call it
    with the same parameters); parameters held whole need no communication. Mean, std (with
    Bessel's correction), min, max, norm and the histogram are over the finite values, in
    float64; NaN and Inf are counted. Nothing is modified.
    """
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be an integer >= 1, got {bins!r}")
    if not params:
        raise ValueError("params must hold at least one parameter")
    dtype = str(params[0].dtype).removeprefix("torch.")
    numel = sum(p.numel for p in params)
    shape = params[0].shape if len(params) == 1 else (numel,)
    started = time.perf_counter()
    pieces = [part_of(p) for p in params]

    first = _reduced(pieces, _first_round, _combine_first)
    counted = int(first[_FINITE] + first[_NAN] + first[_INF])
    if counted != numel:
        raise RuntimeError(
            f"the pieces of {fqn!r} hold {counted} elements, the tensor {numel}: its placements "
            f"do not split it into disjoint pieces"
        )
    finite = int(first[_FINITE])
    lo = hi = mean = std = norm = math.nan
    counts, edges = torch.zeros(bins), torch.zeros(bins + 1)
    if finite:
        lo, hi = float(first[_MIN]), float(first[_MAX])
        top = hi if hi > lo else lo + 1.0
        mean = float(first[_SUM]) / finite
        norm = math.sqrt(float(first[_SQUARES]))
        second = _reduced(pieces, lambda p: _second_round(p, mean, lo, top, bins), _sum_rows)
        std = math.sqrt(float(second[0]) / (finite - 1)) if finite > 1 else 0.0
        counts = second[1:]
        edges = torch.linspace(lo, top, bins + 1)
    logger.debug(
        "stats of %s: %d elements, %d held here, gathered over groups of %s, in %.3f s",
        fqn,
        numel,
        sum(p.values.numel() for p in pieces),
        sorted({dist.get_world_size(g) for p in pieces for g in p.groups}) or "none",
        time.perf_counter() - started,
    )
    return TensorStats(
        fqn=fqn,
        names=tuple(p.fqn for p in params),
        shape=tuple(int(s) for s in shape),
        dtype=dtype,
        numel=numel,
        mean=mean,
        std=std,
        min=lo,
        max=hi,
        norm=norm,
        nan_count=int(first[_NAN]),
        inf_count=int(first[_INF]),
        hist_counts=tuple(int(c) for c in counts.tolist()),
        hist_edges=tuple(float(e) for e in edges.tolist()),
    )


Combine = Callable[[torch.Tensor], torch.Tensor]


def _reduced(
    pieces: list[Part], local_row: Callable[[Part], torch.Tensor], combine: Combine
) -> torch.Tensor:
    """``combine`` of every piece's ``local_row`` over all ranks: a float64 CPU row.

    Pieces split over the same groups are combined here first, then gathered once per
    group; each rank combines the gathered rows in rank order, so all ranks get the same
    bits.  An all-gather of a few numbers rather than all-reduces: one collective takes
    sums, minima and maxima together.
    """
    # Keyed by the groups' ranks, which every rank computes alike (not by the group
    # objects: a mesh may hand out a new Python object for the same group).
    by_groups: dict[tuple[tuple[tuple[int, ...], ...], torch.device], list[Part]] = {}
    for piece in pieces:
        ranks = tuple(tuple(dist.get_process_group_ranks(g)) for g in piece.groups)
        by_groups.setdefault((ranks, piece.comm_device), []).append(piece)
    rows = []
    for members in by_groups.values():
        row = combine(torch.stack([local_row(p).cpu() for p in members]))
        for group in members[0].groups:
            row = _gather_combined(row, group, members[0].comm_device, combine)
        rows.append(row)
    return combine(torch.stack(rows))


def _gather_combined(
    row: torch.Tensor, group: dist.ProcessGroup, device: torch.device, combine: Combine
) -> torch.Tensor:
    """``combine`` of ``row`` as every rank of ``group`` holds it (collective)."""
    sent = row.to(device)
    received = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
    dist.all_gather(received, sent, group=group)
    return combine(torch.stack(received).cpu())


def _combine_first(rows: torch.Tensor) -> torch.Tensor:
    combined = rows.sum(0)
    combined[_MIN] = rows[:, _MIN].min()
    combined[_MAX] = rows[:, _MAX].max()
    return combined


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows.sum(0)


def _chunks(piece: Part) -> list[tuple[int, torch.Tensor]]:
    return list(enumerate(piece.values.split(_CHUNK))) if piece.values.numel() else []


def _first_round(piece: Part) -> torch.Tensor:
    """[finite count, NaN, Inf, sum, sum of squares, min, max] of ``piece`` (float64)."""
    row = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64)
    work = _buffer(piece)
    for index, chunk in _chunks(piece):
        x = work[: chunk.numel()].copy_(chunk)
        low, high = torch.aminmax(x)
        # min/max propagate NaN and show Inf: finite bounds mean the chunk is all finite.
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            piece.nonfinite_chunks.add(index)
            row[_NAN] += float(x.isnan().sum())
            row[_INF] += float(x.isinf().sum())
            x = x[x.isfinite()]
            if not x.numel():
                continue
            low, high = torch.aminmax(x)
        row[_FINITE] += x.numel()
        row[_SUM] += float(x.sum())
        row[_SQUARES] += float(torch.dot(x, x))
        row[_MIN] = min(float(row[_MIN]), float(low))
        row[_MAX] = max(float(row[_MAX]), float(high))
    return row


def _second_round(piece: Part, mean: float, lo: float, top: float, bins: int) -> torch.Tensor:
    """[sum of squared deviations from ``mean``, histogram counts over [lo, top]]."""
    row = torch.zeros(1 + bins, dtype=torch.float64)
    work, spare = _buffer(piece), _buffer(piece)
    index = _buffer(piece, torch.int32 if bins < 2**31 - 1 else torch.int64)
    for number, chunk in _chunks(piece):
        x = work[: chunk.numel()].copy_(chunk)
        if number in piece.nonfinite_chunks:
            x = x[x.isfinite()]
            if not x.numel():
                continue
        deviation = torch.sub(x, mean, out=spare[: x.numel()])
        row[0] += float(torch.dot(deviation, deviation))
        row[1:] += histogram(x, lo, top, bins, index[: x.numel()])
    return row


def histogram(
    x: torch.Tensor, lo: float, top: float, bins: int, index: torch.Tensor
) -> torch.Tensor:
    """``torch.histc(x, bins, lo, top)`` of float64 values within [lo, top], as float64 CPU
    counts.  ``x`` is overwritten; ``index`` (an integer tensor of ``x``'s size) is scratch.

    On the CPU the bins are computed as torch's CPU histc kernel computes them (the bin of
    ``v`` is ``int64((v - lo) * bins / (top - lo))``, and the last bin is closed on the
    right: ``top`` counts in it) and counted with ``bincount``: the same bins, several
    times faster than histc's generic N-dimensional loop.  On other devices
    ``torch.histc`` itself (CUDA's division by a scalar multiplies by its reciprocal, so
    the formula above would not reproduce CUDA's bins).
    """
    if x.device.type != "cpu":
        return torch.histc(x, bins=bins, min=lo, max=top).to("cpu", torch.float64)
    index.copy_(x.sub_(lo).mul_(bins).div_(top - lo))  # truncates, as the kernel's cast does
    counts = torch.bincount(index, minlength=bins + 1).to(torch.float64)
    counts[bins - 1] += counts[bins]  # values equal to top
    return counts[:bins]


def _buffer(piece: Part, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Working memory for one chunk of ``piece``, on the piece's own device."""
    size = min(piece.values.numel(), _CHUNK)
    return torch.empty(size, dtype=dtype, device=piece.values.device)
