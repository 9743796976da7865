"""The layout picture draws every rank's slice visibly, also on a hybrid (2x2) mesh."""

from __future__ import annotations

from matplotlib.patches import Rectangle

from fsdp_interactive.inspect import ModelLayout, ParamLayout, RankTotals, ShardSlice
from fsdp_interactive.notebook.plots import layout_figure


def _one_weight(
    shape: tuple[int, int], slices: tuple[ShardSlice, ...], placements: tuple[str, ...], **mesh
) -> ModelLayout:
    """A model of one float32 weight ``w`` laid out as ``slices`` (one per rank)."""
    param = ParamLayout(
        fqn="w",
        global_shape=shape,
        dtype="float32",
        element_size=4,
        is_dtensor=any(p.startswith("Shard") for p in placements),
        placements=placements,
        mesh_shape=mesh.get("mesh_shape", (len(slices),)),
        mesh_dim_names=mesh.get("mesh_dim_names"),
        requires_grad=True,
        slices=slices,
    )
    held = 4 * shape[0] * shape[1] // len(slices)
    totals = tuple(RankTotals(s.rank, held, 0, 0, 0) for s in slices)
    return ModelLayout(world_size=len(slices), params=(param,), ranks=totals)


def _hybrid_layout() -> ModelLayout:
    """An (8, 6) weight on a (replicate=2, shard=2) mesh: ranks 0 and 2 hold rows 0-3."""
    slices = tuple(
        ShardSlice(rank=r, local_shape=(4, 6), offset=(4 * (r % 2), 0), numel=24, padded_numel=24)
        for r in range(4)
    )
    mesh = {"mesh_shape": (2, 2), "mesh_dim_names": ("replicate", "shard")}
    return _one_weight((8, 6), slices, ("Replicate()", "Shard(dim=0)"), **mesh)


def test_replicas_of_a_hybrid_mesh_are_stacked_not_overdrawn() -> None:
    bars = layout_figure(_hybrid_layout()).axes[0]
    boxes = [
        (round(p.get_x(), 6), round(p.get_y(), 6), round(p.get_width(), 6), p.get_height())
        for p in bars.patches
        if isinstance(p, Rectangle) and p.get_fill()
    ]
    assert len(boxes) == 4
    assert len(set(boxes)) == 4, f"two ranks drawn on the same spot: {boxes}"
    labels = sorted(t.get_text() for t in bars.texts)
    assert labels == ["r0", "r1", "r2", "r3"]


def _flat_layout(placements: tuple[str, ...], runs: list[tuple[int, int]]) -> ModelLayout:
    """A (4, 5) weight held as runs of its flattened elements (torch FSDP1's flat shards)."""
    slices = tuple(
        ShardSlice(r, (n,), (start // 5, start % 5), n, n, flat=True)
        for r, (start, n) in enumerate(runs)
    )
    return _one_weight((4, 5), slices, placements)


def _boxes(model_layout: ModelLayout) -> list[tuple[float, float]]:
    bars = layout_figure(model_layout).axes[0]
    return [
        (round(p.get_x(), 6), round(p.get_width(), 6))
        for p in bars.patches
        if isinstance(p, Rectangle) and p.get_fill()
    ]


def test_flat_shards_are_drawn_where_their_runs_lie() -> None:
    """Rank 0 holds elements 0-12, rank 1 13-19 (uneven, as FSDP1's padding leaves them)."""
    assert _boxes(_flat_layout(("FlatShard()",), [(0, 13), (13, 7)])) == [(0, 0.65), (0.65, 0.35)]
    # NO_SHARD: every rank holds all of it, side by side as replicas are drawn.
    assert _boxes(_flat_layout(("Replicate()",), [(0, 20), (0, 20)])) == [(0, 0.5), (0.5, 0.5)]
