"""Every probe on the models users bring, against each framework's own tools, at 2 and 4 ranks.

For each wrapping of :data:`tests.inspect._wrapped_models.CASES` (torch FSDP1 with flat or
original parameters under FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD and NO_SHARD, DDP,
``torch.compile``, activation checkpointing with DDP and with torch FSDP1, Lightning Fabric
with DDP and with ``fully_shard``, accelerate):

* ``grad_norms`` equals the framework's ``clip_grad_norm_`` (1e-5 relative), and the full
  gradient's norm per parameter where the framework shows full gradients;
* ``layout`` lists the clean names the framework's state dict has, with their true global
  shapes, and every rank's slice holds exactly what that rank stores of the summoned full
  tensor (as the framework shows its local data); the slices cover every element;
* ``summon_stats`` equals the statistics of the summoned full tensor, by clean and by
  wrapped name; ``edit_param`` changes what the framework then summons;
* each parameter names its FSDP unit (FSDP1 modules, ``fully_shard`` modules), or none.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_interactive.inspect import (
    GradNormRecorder,
    edit_param,
    full_param,
    grad_norms,
    layout,
    merge_layouts,
    summon_stats,
)
from tests.inspect._full_stats import assert_equal_stats, full_tensor_stats
from tests.inspect._wrapped_models import (
    CASES,
    FSDP1_CASES,
    build,
    flat_runs_in_order,
    require_framework,
)

RTOL = 1e-5
BINS = 7
UNITS = {
    "embed.weight": "",
    "blocks.0.attn.qkv.weight": "blocks.0",
    "blocks.1.mlp.2.bias": "blocks.1",
}
SHARDED_UNITS = (*FSDP1_CASES, "checkpointed-fsdp1", "fabric-fully_shard")


def _probe(case: str) -> dict:
    """Every probe on ``case``, with the framework's truth (on every rank)."""
    wrapped = build(case)
    model = wrapped.model
    full = wrapped.full_params()
    out = {
        "rank": dist.get_rank(),
        "layout": layout(model),
        "described_once": layout(model, params_from_rank=0),
        "norms": grad_norms(model),
        "recorded": GradNormRecorder(model).record().total,
        "framework_norm": wrapped.framework_norm(),
        "full": full,
        "full_grads": wrapped.full_grads(),
        "local": wrapped.local_data(),
        "stats": {fqn: summon_stats(model, fqn, bins=BINS) for fqn in full},
        "module_stats": summon_stats(model, "blocks.1", bins=BINS),
    }
    # Wrapped names: each registered parameter's, or (a flat parameter) its module's.
    by_wrapped = {}
    for name, _ in model.named_parameters():
        wrapped_name = name.rsplit(".", 1)[0] if name.endswith("_flat_param") else name
        by_wrapped[wrapped_name] = summon_stats(model, wrapped_name, bins=BINS)
    out["by_wrapped"] = by_wrapped
    before = full["head.bias"].clone(), full["blocks.0.mlp.2.weight"].clone()
    edit_param(model, "head.bias", "x + 1")
    edit_param(model, "blocks.0.mlp.2.weight", "x[0] = 0")
    after = wrapped.full_params()
    expected_weight = before[1].clone()
    expected_weight[0] = 0
    out["edited"] = (
        torch.equal(after["head.bias"], before[0] + 1),
        torch.equal(after["blocks.0.mlp.2.weight"], expected_weight),
        torch.equal(full_param(model, "head.bias"), after["head.bias"]),
    )
    return out


def _flat_start(offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    start, stride = 0, 1
    for size, index in zip(reversed(shape), reversed(offset), strict=True):
        start += index * stride
        stride *= size
    return start


def _held(full: torch.Tensor, piece) -> torch.Tensor:
    """What the slice ``piece`` of ``full`` holds, flattened."""
    if piece.flat:
        start = _flat_start(piece.offset, tuple(full.shape))
        return full.reshape(-1)[start : start + piece.numel]
    block = full
    for dim, (start, size) in enumerate(zip(piece.offset, piece.local_shape, strict=True)):
        block = block.narrow(dim, start, size)
    return block.reshape(-1)


def _check_layout(case: str, results: list[dict]) -> None:
    merged = merge_layouts([r["layout"] for r in results])
    once = merge_layouts([r["described_once"] for r in results])
    assert once.params == merged.params
    full = results[0]["full"]
    # Clean names: those of the framework's own state dict, nothing else.
    assert sorted(p.fqn for p in merged.params) == sorted(full), case
    world = len(results)
    for p in merged.params:
        assert p.global_shape == tuple(full[p.fqn].shape), (case, p.fqn)
        assert sorted(s.rank for s in p.slices) == list(range(world)), (case, p.fqn)
        covered = torch.zeros(full[p.fqn].numel(), dtype=torch.int64)
        index = torch.arange(covered.numel()).reshape(full[p.fqn].shape)
        for piece in p.slices:
            covered[_held(index, piece)] += 1
        assert bool((covered > 0).all()), (case, p.fqn, p.slices)
        assert len(set(covered.tolist())) == 1, (case, p.fqn)  # every element equally often
        assert sum(s.numel for s in p.slices) == covered.sum(), (case, p.fqn)
    if case in SHARDED_UNITS:
        assert {n: merged.param(n).unit for n in UNITS} == UNITS, case
    else:
        assert all(p.unit is None for p in merged.params), case
    # Each rank's slices hold what it stores, as the framework shows its local data.
    order = list(full)
    for result in results:
        rank = result["rank"]
        for names, local, is_flat in result["local"]:
            runs = [
                _held(full[name], merged.param(name).slice_of(rank))
                for name in order
                if name in names
            ]
            if is_flat:
                assert flat_runs_in_order(local, runs), (case, rank, sorted(names))
            else:
                assert torch.equal(local.reshape(-1), runs[0]), (case, rank, sorted(names))


def _check_values(case: str, results: list[dict]) -> None:
    full = results[0]["full"]
    for result in results:
        norms = result["norms"]
        truth = result["framework_norm"]
        assert truth > 0 and norms.total == pytest.approx(truth, rel=RTOL), case
        assert result["recorded"] == pytest.approx(truth, rel=RTOL), case
        for name, grad in result["full_grads"].items():
            assert norms.params[name] == pytest.approx(float(grad.norm()), rel=RTOL), name
        assert sorted(norms.params) == sorted(full), case
        for fqn, stats in result["stats"].items():
            assert stats.fqn == fqn
            assert_equal_stats(stats, full_tensor_stats([full[fqn]], BINS), scale=10.0)
        block = [full[n] for n in full if n.startswith("blocks.1.")]
        module_stats = result["module_stats"]
        assert module_stats.fqn == "blocks.1" and len(module_stats.names) == len(block)
        assert module_stats.numel == sum(t.numel() for t in block)
        for wrapped_name, stats in result["by_wrapped"].items():
            prefix = f"{stats.fqn}." if stats.fqn else ""
            expected = [n for n in full if n == stats.fqn or n.startswith(prefix)]
            assert sorted(stats.names) == sorted(expected) and expected, (case, wrapped_name)
            if stats.fqn in full:
                assert stats == result["stats"][stats.fqn], (case, wrapped_name)
        assert result["edited"] == (True, True, True), case


def _run(ranks, case: str) -> None:
    require_framework(case)
    results = ranks.run(_probe, case)
    _check_layout(case, results)
    _check_values(case, results)


@pytest.mark.parametrize("case", CASES)
def test_probes_equal_the_frameworks_own_at_2_ranks(ranks2, case):
    _run(ranks2, case)


@pytest.mark.world4
@pytest.mark.parametrize("case", CASES)
def test_probes_equal_the_frameworks_own_at_4_ranks(ranks4, case):
    _run(ranks4, case)


def test_flat_runs_in_order_can_fail():
    """The check the flat shards go through rejects a wrong order and a stray value."""
    local = torch.tensor([1.0, 2.0, 0.0, 3.0, 0.0])
    assert flat_runs_in_order(local, [torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert not flat_runs_in_order(local, [torch.tensor([3.0]), torch.tensor([1.0, 2.0])])
    assert not flat_runs_in_order(local, [torch.tensor([1.0, 2.0])])
