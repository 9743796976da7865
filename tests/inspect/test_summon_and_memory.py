"""summon_stats()/edit_param() against the full tensor; memory() of each rank."""

from __future__ import annotations

import collections
import dataclasses
import os

import pytest
import torch

from fsdp_interactive.inspect import edit_param, memory, summon_stats
from tests.models import sharded_and_reference


def _stats_vs_full():
    model, reference = sharded_and_reference()
    stats = summon_stats(model, "embed.weight", bins=8)
    block = summon_stats(model, "block")
    full = reference.embed.weight.detach().double()
    block_flat = torch.cat([p.detach().reshape(-1).double() for p in reference.block.parameters()])
    return stats, block, full, block_flat


def test_summon_stats_equal_stats_of_the_full_tensor(ranks2):
    for stats, block, full, block_flat in ranks2.run(_stats_vs_full):
        assert stats.shape == (3, 5) and stats.numel == 15 and stats.dtype == "float32"
        assert stats.mean == pytest.approx(float(full.mean()), rel=1e-9)
        assert stats.std == pytest.approx(float(full.std()), rel=1e-9)
        assert (stats.min, stats.max) == (float(full.min()), float(full.max()))
        assert stats.norm == pytest.approx(float(full.norm()), rel=1e-9)
        assert sum(stats.hist_counts) == 15 and len(stats.hist_edges) == 9
        assert (stats.nan_count, stats.inf_count) == (0, 0)
        assert block.names == ("block.0.weight", "block.0.bias", "block.2.weight", "block.2.bias")
        assert block.numel == block_flat.numel()
        assert block.mean == pytest.approx(float(block_flat.mean()), rel=1e-9)


def _edit_row_zero():
    model, reference = sharded_and_reference()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.embed.weight
    stats = edit_param(model, "embed.weight", "x[0] = 0")
    scaled = edit_param(model, "block.0.bias", "x * 2")
    full = model.embed.weight.full_tensor()
    same_object = model.embed.weight is before and optim.param_groups[0]["params"][0] is before
    expected = reference.embed.weight.detach().clone()
    expected[0] = 0
    with pytest.raises(ValueError, match="shape"):
        edit_param(model, "embed.weight", "x[0]")
    unchanged = torch.equal(model.embed.weight.full_tensor(), full)
    return (
        stats,
        torch.equal(full, expected),
        torch.allclose(model.block[0].bias.full_tensor(), 2 * reference.block[0].bias),
        scaled.numel,
        same_object,
        unchanged,
    )


def test_edit_writes_back_every_shard_and_keeps_the_parameter(ranks2):
    for stats, equal, scaled_ok, numel, same_object, unchanged in ranks2.run(_edit_row_zero):
        assert equal and scaled_ok and same_object and unchanged
        assert numel == 8
        assert stats.min <= 0.0 <= stats.max


def _unknown_name():
    model, _ = sharded_and_reference()
    try:
        summon_stats(model, "nope")
    except KeyError as error:
        return str(error)
    return None


def test_unknown_name_lists_the_real_names(ranks2):
    for message in ranks2.run(_unknown_name):
        assert "no parameter or module named 'nope'" in message and "embed.weight" in message


def test_memory_reports_this_process():
    stats = memory()
    assert stats.pid == os.getpid()
    assert stats.rss_bytes > 10 * 2**20
    assert stats.device == "cpu" and stats.allocated_bytes is None


def _pull_copies():
    from fsdp_interactive.inspect import plain_copy

    model, reference = sharded_and_reference()
    state = plain_copy(model.state_dict())
    weight = plain_copy(model.embed.weight)
    errors = []
    for call in (
        lambda: plain_copy(model),
        lambda: plain_copy(model.embed.weight, max_bytes=10, name="w"),
    ):
        try:
            call()
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    ok = all(
        type(t) is torch.Tensor and torch.equal(t, reference.state_dict()[k])
        for k, t in state.items()
    )
    return ok, torch.equal(weight, reference.embed.weight), errors


def test_plain_copy_gathers_tensors_and_refuses_modules_and_big_values(ranks2):
    for ok, weight_ok, errors in ranks2.run(_pull_copies):
        assert ok and weight_ok
        assert "is a module" in errors[0]
        assert "too large to pull: w is 60 bytes" in errors[1]


PulledPair = collections.namedtuple("PulledPair", "weight note")


@dataclasses.dataclass
class PulledRecord:
    bias: torch.Tensor
    tags: frozenset


def _pull_nested():
    from fsdp_interactive.inspect import plain_copy

    model, reference = sharded_and_reference()
    pulled = plain_copy(
        {
            "pair": PulledPair(model.embed.weight, "n"),
            "record": PulledRecord(model.embed.bias, frozenset({"a"})),
            "both": [model.embed.weight, model.embed.weight],
        }
    )
    pair, record = pulled["pair"], pulled["record"]
    try:
        plain_copy({"params": {model.embed.weight}})
        refused = None
    except TypeError as error:
        refused = str(error)
    return {
        "types": (type(pair).__name__, type(record).__name__, type(pair.weight), type(record.bias)),
        "pair": torch.equal(pair.weight, reference.embed.weight),
        "record": torch.equal(record.bias, reference.embed.bias) and record.tags == {"a"},
        "tied": pulled["both"][0] is pulled["both"][1],
        "set": refused,
    }


def test_plain_copy_gathers_dtensors_inside_namedtuples_and_dataclasses(ranks2):
    for result in ranks2.run(_pull_nested):
        assert result["types"] == ("PulledPair", "PulledRecord", torch.Tensor, torch.Tensor)
        assert result["pair"] and result["record"] and result["tied"]
        assert "value['params']{item 0} is a DTensor inside a set" in result["set"]
