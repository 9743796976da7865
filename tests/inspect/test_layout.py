"""layout(): slices, padding and byte totals against the unsharded model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_interactive.inspect import layout, merge_layouts
from tests.models import backward, sharded_and_reference


def _layout_on_rank():
    model, reference = sharded_and_reference()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    backward(model)
    optim.step()
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    ref_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    return layout(model, optim), local, ref_bytes


def test_layout_bytes_sum_to_the_model_and_slices_match_local_shards(ranks2):
    results = ranks2.run(_layout_on_rank)
    merged = merge_layouts([r[0] for r in results])
    ref_bytes = results[0][2]
    assert merged.model_bytes == ref_bytes
    assert sum(merged.held_bytes(r) for r in range(2)) == ref_bytes
    for rank, (_, local_shapes, _) in enumerate(results):
        for p in merged.params:
            assert p.slice_of(rank).local_shape == local_shapes[p.fqn], (rank, p.fqn)
            assert p.is_dtensor and p.placements == ("Shard(dim=0)",)


def test_layout_reports_padding_and_per_rank_totals(ranks2):
    results = ranks2.run(_layout_on_rank)
    merged = merge_layouts([r[0] for r in results])
    weight = merged.param("embed.weight")  # (3, 5) over 2 ranks: rows 2 + 1, second padded
    assert [s.local_shape for s in weight.slices] == [(2, 5), (1, 5)]
    assert [s.offset for s in weight.slices] == [(0, 0), (2, 0)]
    assert [s.padding for s in weight.slices] == [0, 5]
    for totals in merged.ranks:
        padded = sum(p.slice_of(totals.rank).padded_numel * p.element_size for p in merged.params)
        assert totals.param_bytes == padded
        # after one Adam step: grads as big as the real shard, two moments per element
        held = merged.held_bytes(totals.rank)
        assert totals.grad_bytes == held
        assert totals.optim_bytes >= 2 * held


def test_merge_layouts_rejects_empty_input():
    with pytest.raises(ValueError, match="at least one RankLayout"):
        merge_layouts([])


def _layout_of_plain_module():
    torch.manual_seed(0)
    return layout(torch.nn.Linear(4, 2)), dist.get_world_size()


def test_plain_module_is_replicated_on_every_rank(ranks2):
    (result, world), _ = ranks2.run(_layout_of_plain_module)
    merged = merge_layouts([result])
    assert merged.param("weight").slices[1].local_shape == (2, 4)
    assert len(merged.param("weight").slices) == world
    assert not merged.param("weight").is_dtensor


def _units_on_rank():
    from tests.models import wrapped_and_reference

    sharded, _ = sharded_and_reference()
    wrapped, _ = wrapped_and_reference()
    described = layout(sharded, params_from_rank=1)
    return layout(sharded), layout(wrapped), described


def test_each_parameter_names_the_fsdp_unit_that_manages_it(ranks2):
    results = ranks2.run(_units_on_rank)
    expected = {"embed.weight": "", "embed.bias": "", "block.0.weight": "block"}
    for plain, wrapped, _ in results:
        for rank_layout in (plain, wrapped):
            units = {p.fqn: p.unit for p in rank_layout.params}
            assert {n: units[n] for n in expected} == expected
            assert units["block.2.bias"] == "block"


def test_params_from_rank_describes_the_parameters_once(ranks2):
    results = ranks2.run(_units_on_rank)
    described = [r[2] for r in results]
    assert [len(d.params) for d in described] == [0, len(results[0][0].params)]
    merged = merge_layouts(described)
    full = merge_layouts([r[0] for r in results])
    assert merged.params == full.params
    assert [t.param_bytes for t in merged.ranks] == [t.param_bytes for t in full.ranks]
    assert all(t.host for t in merged.ranks)


def _plain_units():
    return layout(torch.nn.Linear(4, 2)).params


def test_a_parameter_no_fsdp_unit_manages_has_no_unit(ranks2):
    params, _ = ranks2.run(_plain_units)
    assert [p.unit for p in params] == [None, None]
