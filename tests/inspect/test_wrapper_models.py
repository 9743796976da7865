"""The probes on models built with this package's FullyShardedDataParallel wrapper."""

from __future__ import annotations

import pytest
import torch

from fsdp_interactive.inspect import edit_param, grad_norms, layout, merge_layouts, summon_stats
from tests.models import backward, wrapped_and_reference


def _probe_wrapped():
    model, reference = wrapped_and_reference()
    backward(model)
    backward(reference)
    norms = grad_norms(model)
    wrapper_total = float(type(model).clip_grad_norm_(model, 1e9))
    reference_total = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
    stats = summon_stats(model, "block.0.weight")
    full = reference.block[0].weight.detach().double()
    edited = edit_param(model, "embed.bias", "x + 1")
    with type(model).summon_full_params(model, writeback=False):
        bias = model.embed.bias.detach().clone()
    ref_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    return (
        layout(model),
        ref_bytes,
        norms,
        wrapper_total,
        reference_total,
        stats,
        (float(full.mean()), float(full.std()), float(full.norm())),
        edited,
        torch.equal(bias, reference.embed.bias.detach() + 1),
    )


def test_probes_work_on_the_wrapper(ranks2):
    results = ranks2.run(_probe_wrapped)
    merged = merge_layouts([r[0] for r in results])
    for _, ref_bytes, norms, wrapper_total, ref_total, stats, truth, edited, ok in results:
        assert merged.model_bytes == ref_bytes
        assert sum(merged.held_bytes(r) for r in range(2)) == ref_bytes
        assert norms.total == pytest.approx(wrapper_total, rel=1e-5)
        assert norms.total == pytest.approx(ref_total, rel=1e-5)
        assert (stats.mean, stats.std, stats.norm) == pytest.approx(truth, rel=1e-9)
        assert edited.fqn == "embed.bias" and ok
    assert {p.fqn for p in merged.params} == {
        "embed.weight",
        "embed.bias",
        "block.0.weight",
        "block.0.bias",
        "block.2.weight",
        "block.2.bias",
    }


def _summoned_units():
    """Which units summon_stats/edit_param gather: a nested unit's parameter, a root's."""
    from fsdp_interactive.inspect import _summon_stats

    model, reference = wrapped_and_reference()
    summoned: list[str] = []
    names = {id(m): name for name, m in model.named_modules()}
    real = _summon_stats.summon_full_params

    def spy(module, *args, **kwargs):
        summoned.append(names[id(module)])
        return real(module, *args, **kwargs)

    _summon_stats.summon_full_params = spy
    try:
        nested = summon_stats(model, "block.0.weight")
        nested_units = list(summoned)
        summoned.clear()
        edit_param(model, "embed.bias", "x + 1")
        root_units = list(summoned)
    finally:
        _summon_stats.summon_full_params = real
    truth = reference.block[0].weight.detach().double()
    with type(model).summon_full_params(model, writeback=False):
        bias = model.embed.bias.detach().clone()
        block_weight = model.block[0].weight.detach().clone()
    return (
        nested_units,
        root_units,
        (nested.mean, nested.norm),
        (float(truth.mean()), float(truth.norm())),
        torch.equal(bias, reference.embed.bias.detach() + 1),
        torch.equal(block_weight, reference.block[0].weight.detach()),
    )


def test_stats_gather_no_unit_and_an_edit_only_the_unit_that_owns_it(ranks2):
    for nested, root, stats, truth, edited, untouched in ranks2.run(_summoned_units):
        # Statistics are taken on the shards: no unit is gathered for them.
        assert nested == [], nested
        # edit_param gathers the root unit once, for the edit (its new stats, none).
        assert root == [""], root
        assert stats == pytest.approx(truth, rel=1e-9)
        assert edited and untouched
