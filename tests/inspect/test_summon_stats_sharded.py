"""summon_stats computed on the shards equals the statistics of the unsharded tensor.

Each case runs on real gloo ranks and compares with the statistics the probe used to take
of the gathered full tensor (:func:`full_tensor_stats`, computed here on the unsharded
copy): counts, min, max and histogram exactly, mean, std and norm to float64 rounding.
The collectives the probe issues are recorded: a few numbers each, on the mesh's device.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.inspect._full_stats import (
    CASES,
    INF,
    NAN,
    assert_equal_stats,
    chunk_size,
    full_tensor_stats,
    members,
    poisoned_model,
    recorded_collectives,
    stats_of_kept_and_offloaded_shards,
)


def _fsdp_stats(dtype_name: str, chunk: int) -> list[tuple]:
    """fully_shard over 2 ranks vs the unsharded copy, for every case in CASES."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_interactive.inspect import summon_stats

    reference = poisoned_model(getattr(torch, dtype_name))
    model = copy.deepcopy(reference)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    assert model.gain.to_local().numel() in (0, 4)  # rank 1 holds none of it
    out = []
    with chunk_size(chunk), recorded_collectives() as calls:
        for fqn in CASES:
            calls.clear()
            stats = summon_stats(model, fqn, bins=7)
            out.append((stats, full_tensor_stats(members(reference, fqn), 7), list(calls)))
    return out


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_fsdp_shards_give_the_stats_of_the_full_tensor(ranks2, dtype_name, chunk):
    results = ranks2.run(_fsdp_stats, dtype_name, chunk)
    for rank_results in results:
        for stats, reference, calls in rank_results:
            assert stats.dtype == dtype_name
            assert_equal_stats(stats, reference, scale=8.0)
            # Two rounds of a few numbers each (one when nothing is finite: no spread, no
            # histogram), over the 2 ranks, on the mesh's device.
            assert len(calls) == (1 if math.isnan(reference["mean"]) else 2), (stats.fqn, calls)
            assert all(c.group_size == 2 and c.numel <= 8 for c in calls), calls
            assert all(c.device.type == "cpu" and c.output_devices == {c.device} for c in calls)
    by_rank = [[record_values(s) for s, _, _ in r] for r in results]
    assert by_rank[0] == by_rank[1]  # every rank answers the same, to the bit
    embed = results[0][0][0]
    assert (embed.nan_count, embed.inf_count, embed.numel) == (1, 2, 33)
    assert results[0][5][0].names == ("proj.weight", "proj.bias")
    assert math.isnan(results[0][4][0].mean) and results[0][4][0].nan_count == 6


def record_values(stats) -> tuple:
    """The stats as a tuple that compares NaN equal to NaN (by its text)."""
    return tuple(repr(v) for v in vars(stats).values())


def _dtensor_and_plain_stats() -> list[tuple]:
    """DTensors built without FSDP (split along dim 1, unevenly; replicated) and plain ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdp_interactive.inspect import summon_stats

    torch.manual_seed(1)
    mesh = init_device_mesh("cpu", (2,))
    columns = torch.randn(4, 7) * 3 + 1
    columns[2, 5] = NAN
    table = torch.randn(5, 2)
    holder = nn.Module()
    holder.columns = nn.Parameter(distribute_tensor(columns, mesh, [Shard(1)]))
    holder.table = nn.Parameter(distribute_tensor(table, mesh, [Replicate()]))
    plain = nn.Module()
    plain.weight = nn.Parameter(torch.randn(6, 6) * 1e-3 + 2.0)
    plain.bias = nn.Parameter(torch.tensor([INF, 1.0, 2.0]))
    cases = [
        (holder, "columns", [columns]),
        (holder, "table", [table]),
        (holder, "", [columns, table]),
        (plain, "weight", [plain.weight]),
        (plain, "", [plain.weight, plain.bias]),
    ]
    out = []
    with chunk_size(4), recorded_collectives() as calls:
        for model, fqn, tensors in cases:
            calls.clear()
            stats = summon_stats(model, fqn, bins=5)
            out.append((stats, full_tensor_stats(tensors, 5), [c.group_size for c in calls]))
    return out


def test_dtensors_without_fsdp_and_plain_tensors(ranks2):
    for rank_results in ranks2.run(_dtensor_and_plain_stats):
        gathered = []
        for stats, reference, group_sizes in rank_results:
            assert_equal_stats(stats, reference, scale=10.0)
            gathered.append(group_sizes)
        # Only the split tensor communicates; replicated and plain ones are whole here.
        assert gathered == [[2, 2], [], [2, 2], [], []]


def _hybrid_stats() -> list[tuple]:
    """(replicate, shard) mesh of 2x2: the pieces differ along the shard dimension only."""
    from fsdp_interactive.inspect import summon_stats
    from tests.models import sharded_and_reference

    model, reference = sharded_and_reference(mesh_shape=(2, 2))
    out = []
    with recorded_collectives() as calls:
        for fqn in ("embed.weight", "block"):
            calls.clear()
            stats = summon_stats(model, fqn, bins=6)
            reference_stats = full_tensor_stats(members(reference, fqn), 6)
            out.append((stats, reference_stats, [c.group_size for c in calls]))
    return out


@pytest.mark.world4
def test_hybrid_mesh_gathers_over_the_shard_dimension_only(ranks4):
    for rank_results in ranks4.run(_hybrid_stats):
        for stats, reference, group_sizes in rank_results:
            assert_equal_stats(stats, reference, scale=2.0)
            assert group_sizes == [2, 2]


def _first_collectives_on_the_communication_device() -> dict:
    """With every communication device ``meta`` (standing in for CUDA under NCCL), the
    first collective of a statistics call and of an edit, while the shards stay on the CPU."""
    from fsdp_interactive.inspect import edit_param, summon_stats
    from tests.device_standins import first_collective
    from tests.models import sharded_and_reference, wrapped_and_reference

    model, _ = sharded_and_reference()
    wrapped, _ = wrapped_and_reference()
    reached = {
        "stats": first_collective(lambda: summon_stats(model, "embed.weight")),
        "module stats": first_collective(lambda: summon_stats(model, "block")),
        "wrapper stats": first_collective(lambda: summon_stats(wrapped, "block.0.weight")),
        "edit": first_collective(lambda: edit_param(model, "embed.weight", "x * 1")),
    }
    shards = {p.to_local().device.type for p in model.parameters()}
    return {"shards": shards, **{k: (r.name, sorted(set(r.devices))) for k, r in reached.items()}}


def test_collectives_take_the_communication_device_not_the_shards(ranks2):
    for result in ranks2.run(_first_collectives_on_the_communication_device):
        assert result.pop("shards") == {"cpu"}
        assert result == {
            "stats": ("all_gather", ["meta"]),
            "module stats": ("all_gather", ["meta"]),
            "wrapper stats": ("all_gather", ["meta"]),
            "edit": ("full_tensor", ["meta"]),
        }


def test_the_cuda_check_of_kept_and_offloaded_shards_runs_on_gloo(ranks2):
    """tests/inspect/test_cuda.py's check on NCCL ranks, here on CPU ranks: its plumbing."""
    for calls in ranks2.run(stats_of_kept_and_offloaded_shards):
        # 7 names: two rounds each, one for the tensor with no finite value.
        assert calls == {"kept": 13, "offloaded": 13, "wrapper offloaded": 13}


def test_histogram_bins_equal_histc_at_the_bin_edges():
    """The CPU bin formula against torch.histc, with values on and next to every edge."""
    from fsdp_interactive.inspect._shard_stats import histogram

    generator = torch.Generator().manual_seed(0)
    for bins, scale, offset in (
        (1, 1.0, 0.0),
        (7, 1e-30, 3e-29),
        (40, 1e20, -5e21),
        (333, 3.0, 1.0),
    ):
        x = torch.randn(2000, dtype=torch.float64, generator=generator) * scale + offset
        lo, hi = float(x.min()), float(x.max())
        edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
        up = torch.nextafter(edges, torch.full_like(edges, INF))
        down = torch.nextafter(edges, torch.full_like(edges, -INF))
        x = torch.cat([x, edges, up, down])
        x = x[(x >= lo) & (x <= hi)]
        expected = torch.histc(x, bins, lo, hi)
        index = torch.empty(x.numel(), dtype=torch.int32)
        assert torch.equal(histogram(x.clone(), lo, hi, bins, index), expected), (bins, scale)


def test_bad_arguments_are_named():
    from fsdp_interactive.inspect._shard_stats import tensor_stats
    from fsdp_interactive.wrapping import model_params

    weight = model_params(nn.Linear(2, 2))["weight"]
    with pytest.raises(ValueError, match="bins must be an integer >= 1, got 0"):
        tensor_stats("weight", [weight], 0)
    with pytest.raises(ValueError, match="params must hold at least one parameter"):
        tensor_stats("weight", [], 4)
