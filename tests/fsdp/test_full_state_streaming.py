"""Full state dicts go to the CPU one tensor at a time, on two gloo ranks.

On a GPU, a full state dict gathered whole before ``.cpu()`` needs the whole model (or
optimizer state) on each device at once. Here every gather's result stands for a device
tensor (``tests.device_standins.gathers_on_device``: it lives until it is copied to the
CPU or dropped), and the bytes of such tensors alive at once are counted: the peak must
stay at one tensor's size (below one unit's), never the model's. The rank-0 optimizer
load is measured the same way on the receiving rank: the tensors handed to
``broadcast`` alive at once, which must stay within one unit (the tensor in flight, and
at times the previous one, which the process group's worker thread may still hold for a
moment after the collective returned: c10d releases completed work on its own thread).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.device_standins import LiveBytes, broadcasts_tracked, gathers_on_device, nbytes

WIDTH = 24
UNITS = 4


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    units = (nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(UNITS))
    model = FSDP(
        nn.Sequential(*units),
        auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),  # two layers a unit, and the root
        use_orig_params=True,
    )
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    model(torch.randn(3, WIDTH)).sum().backward()
    optim.step()
    return model, optim


def _sizes(model: nn.Module) -> dict[str, int]:
    params = list(model.parameters())
    unit = max(sum(nbytes(p) for p in layer.parameters()) for layer in model.module)
    return {
        "largest tensor": max(nbytes(p) for p in params),
        "largest unit": unit,
        "model": sum(nbytes(p) for p in params),
    }


def _reference(model: nn.Module) -> dict[str, torch.Tensor]:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def peaks_of_full_state_dicts(rank0_only: bool) -> dict:
    from fsdp_interactive.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
        _fqn_state,
    )
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model, optim = _model()
    reference = _reference(model)
    configs = (
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
    )

    def state_dict():
        with FSDP.state_dict_type(model, *configs):
            return model.state_dict()

    def optim_state_dict():
        with FSDP.state_dict_type(model, *configs):
            return FSDP.optim_state_dict(model, optim)

    runs = {
        "state_dict": state_dict,
        "model_state": lambda: _fqn_state.model_state(
            model, full=True, cpu_offload=True, rank0_only=rank0_only
        ),
        "optim_state_dict": optim_state_dict,
    }
    out: dict = {"sizes": _sizes(model), "rank": dist.get_rank()}
    for name, run in runs.items():
        counter = LiveBytes()
        with gathers_on_device(counter):
            result = run()
        kept = result.get("state", result)
        values_ok = all(
            type(v) is torch.Tensor and v.device.type == "cpu"
            for entry in kept.values()
            for v in (entry.values() if isinstance(entry, dict) else [entry])
        )
        if name != "optim_state_dict" and kept:
            values_ok = values_ok and all(torch.equal(kept[n], reference[n]) for n in reference)
        out[name] = {
            "peak": counter.peak,
            "gathered": counter.total,
            "entries": len(kept),
            "plain cpu values": values_ok,
        }
    return out


@pytest.mark.parametrize("rank0_only", [False, True])
def test_full_state_dicts_hold_one_gathered_tensor_at_a_time(ranks2, rank0_only):
    for result in ranks2.run(peaks_of_full_state_dicts, rank0_only):
        sizes = result["sizes"]
        assert sizes["model"] >= 3 * sizes["largest unit"], sizes  # a peak can tell them apart
        expected_gathered = {
            "state_dict": sizes["model"],
            "model_state": sizes["model"],
            "optim_state_dict": 2 * sizes["model"],  # Adam: exp_avg and exp_avg_sq
        }
        for name, gathered in expected_gathered.items():
            measured = result[name]
            assert measured["gathered"] == gathered, (name, measured, sizes)
            assert 0 < measured["peak"] <= sizes["largest tensor"], (name, measured, sizes)
            assert measured["plain cpu values"], (name, measured)
            if rank0_only and result["rank"] != 0:
                assert measured["entries"] == 0, (name, measured)
            else:
                assert measured["entries"] > 0, (name, measured)


def peak_of_rank0_optimizer_load() -> dict:
    from fsdp_interactive._torch_compat import local_tensor
    from fsdp_interactive.fsdp import FullOptimStateDictConfig, StateDictType
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model, optim = _model()
    config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    counter = LiveBytes()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None, config):
        osd = FSDP.optim_state_dict(model, optim)
        with broadcasts_tracked(counter):
            loadable = FSDP.optim_state_dict_to_load(model, optim, osd)
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    fresh.load_state_dict(loadable)
    same, compact = True, True
    for param, state in optim.state.items():
        for key, value in state.items():
            loaded = fresh.state[param][key]
            same = same and torch.equal(local_tensor(loaded), local_tensor(value))
            local = local_tensor(loaded)
            compact = compact and local.untyped_storage().nbytes() == nbytes(local)
    return {
        "rank": dist.get_rank(),
        "peak": counter.peak,
        "broadcast": counter.total,
        "sizes": _sizes(model),
        "loaded equals saved": same,
        "no views of full tensors kept": compact,
    }


def test_rank0_optimizer_load_receives_one_tensor_at_a_time(ranks2):
    for result in ranks2.run(peak_of_rank0_optimizer_load):
        sizes = result["sizes"]
        assert result["loaded equals saved"] and result["no views of full tensors kept"], result
        # Adam's exp_avg and exp_avg_sq, plus a scalar step per parameter.
        assert result["broadcast"] >= 2 * sizes["model"], result
        assert sizes["model"] >= 3 * sizes["largest unit"], sizes
        assert sizes["largest unit"] >= 2 * sizes["largest tensor"], sizes
        if result["rank"] == 1:  # rank 0 sends its own (CPU) tensors, alive anyway
            assert 0 < result["peak"] <= sizes["largest unit"], result
