"""CUDA/NCCL: what the CPU tests check with stand-ins, on real GPUs. Skipped where no CUDA
device is present.

Each test runs ``min(2, device_count)`` NCCL ranks in spawned processes, one GPU each
(``tests.cuda_ranks``), so everything here also runs on a host with one GPU:

* training parity: ``device_id`` as an int, ``sync_module_states`` from a CPU module,
  bf16, pinned CPU offload, torch's compression hooks unchanged;
* CPU offload over NCCL: ``summon_full_params`` (on the device, offloaded, ``with_grads``),
  FULL state dicts, the full optimizer state and its rank-0 load, ``plain_copy``,
  ``clip_grad_norm_`` -- every gather of a CPU shard runs on the GPU;
* full state dicts stream to the CPU: the device's peak during ``state_dict()``,
  ``optim_state_dict()`` and the rank-0 optimizer load stays within a few tensors, not
  the model (a model of 8 layers of 4 MiB);
* a CPU or meta module without ``device_id`` computes on the current GPU;
* ``ShardedTensor`` values with CPU shards convert over the NCCL group;
* a CPU rank (gloo) on the GPU host never initialises CUDA, with CPU offload.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.cuda_ranks import run_ranks
from tests.fsdp import _common as C
from tests.models import Block

pytestmark = pytest.mark.cuda

STEPS = 3
MiB = 2**20


def _world() -> int:
    return min(2, torch.cuda.device_count())


def _device() -> torch.device:
    """This rank's device: its GPU over NCCL, the CPU over gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _train(model, optim, rank: int, world: int, device) -> list[float]:
    losses = []
    for step in range(STEPS):
        tokens = C.local_part(C.batches(step, world), rank, world)  # CPU: the root moves it
        loss = C.lm_loss(model, tokens.to(device) if step == 0 else tokens)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(C.global_mean(loss))
    return losses


def _reference(world: int, device) -> C.TrainResult:
    model = C.make_model(0).to(device)
    optim = C.make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = C.lm_loss(model, C.batches(step, world).to(device))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return C.TrainResult(losses, {n: p.detach().cpu() for n, p in model.named_parameters()})


def parity_checks() -> dict:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    from fsdp_interactive.fsdp import CPUOffload, MixedPrecision
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    ref = _reference(world, device)
    out = {}
    for label, kwargs, tol in (
        ("fp32", {"sync_module_states": True}, 1e-5),  # CPU module broadcast over NCCL
        ("bf16", {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}, 1e-2),
        ("offload", {"cpu_offload": CPUOffload(offload_params=True)}, 1e-5),
        ("bf16_hook", {"_hook": default_hooks.bf16_compress_hook}, 1e-2),
    ):
        hook = kwargs.pop("_hook", None)
        model = FSDP(
            C.make_model(0),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=device.index,
            use_orig_params=True,
            **kwargs,
        )
        param = model.embed.weight
        if label == "offload":
            assert param.to_local().device.type == "cpu" and param.to_local().is_pinned()
        else:
            assert param.to_local().device == device
        if hook is not None:
            model.register_comm_hook(default_hooks.LowPrecisionState(dist.group.WORLD), hook)
        optim = C.make_optimizer(model.parameters())
        losses = _train(model, optim, rank, world, device)
        with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=True):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert all(p.device.type == "cpu" for p in params.values())
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref.losses, strict=True))
        param_diff = C.max_param_diff(params, ref.params)
        assert loss_diff <= tol and param_diff <= tol, (label, loss_diff, param_diff)
        out[label] = (loss_diff, param_diff)
    return out


def test_fsdp_on_cuda_nccl():
    world = _world()
    for rank, out in enumerate(run_ranks(parity_checks, world)):
        print(f"rank {rank} (world {world}): {out}")


def _tensors_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def offloaded_gathers() -> dict[str, bool]:
    from fsdp_interactive import inspect
    from fsdp_interactive._torch_compat import local_tensor
    from fsdp_interactive.fsdp import (
        CPUOffload,
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    model = FSDP(
        C.make_model(0),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=device,
        cpu_offload=CPUOffload(offload_params=True),
        use_orig_params=True,
    )
    assert model.embed.weight.to_local().device.type == "cpu"
    C.lm_loss(model, C.local_part(C.batches(0, world), rank, world).to(device)).backward()
    out = {}
    with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=True):
        on_cpu = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["summon offload_to_cpu"] = all(p.device.type == "cpu" for p in on_cpu.values())
    with FSDP.summon_full_params(model, writeback=False):
        full = dict(model.named_parameters())
        out["summon on the device"] = all(p.device == device for p in full.values()) and (
            _tensors_equal({n: p.detach() for n, p in full.items()}, on_cpu)
        )
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        out["summon with_grads"] = all(
            p.grad is not None and p.grad.shape == p.shape and p.grad.device == device
            for p in model.parameters()
        )
    for rank0_only in (False, True):
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            sd = model.state_dict()
        if rank0_only and rank != 0:
            out["state_dict rank0_only"] = len(sd) == 0
        else:
            out[f"state_dict rank0_only={rank0_only}"] = all(
                sd[k].device.type == "cpu" for k in sd
            ) and _tensors_equal({k: sd[k] for k in on_cpu}, on_cpu)
    pulled = inspect.plain_copy({"w": model.embed.weight, "pair": (model.head.weight,)})
    out["plain_copy"] = (
        type(pulled["w"]) is torch.Tensor
        and pulled["w"].device.type == "cpu"
        and torch.equal(pulled["w"], on_cpu["embed.weight"])
        and torch.equal(pulled["pair"][0], on_cpu["head.weight"])
    )
    total = model.clip_grad_norm_(1.0)
    out["clip_grad_norm_"] = bool(torch.isfinite(total))
    optim = C.make_optimizer(model.parameters())
    optim.step()
    osd_config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None, osd_config):
        osd = FSDP.optim_state_dict(model, optim)
        loadable = FSDP.optim_state_dict_to_load(model, optim, osd)
    out["optim_state_dict on the cpu"] = rank != 0 or all(
        v.device.type == "cpu"
        for entry in osd["state"].values()
        for v in entry.values()
        if isinstance(v, torch.Tensor)
    )
    fresh = C.make_optimizer(model.parameters())
    fresh.load_state_dict(loadable)
    out["rank-0 optimizer load"] = all(
        torch.equal(local_tensor(fresh.state[p][k]).cpu(), local_tensor(v).cpu())
        for p, state in optim.state.items()
        for k, v in state.items()
    )
    return out


def test_cpu_offloaded_shards_are_gathered_on_the_gpu():
    for out in run_ranks(offloaded_gathers, _world()):
        assert out and all(out.values()), out


def full_state_peaks() -> dict:
    from fsdp_interactive.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    device = _device()
    torch.manual_seed(0)
    model = FSDP(
        nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8))),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        device_id=device,
        use_orig_params=True,
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024, device=device)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)

    def measure(run):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = run()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        return (torch.cuda.max_memory_allocated() - base - kept) / MiB, result

    peaks = {}
    for rank0_only in (False, True):
        configs = (
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only),
        )
        with FSDP.state_dict_type(model, *configs):
            peaks[f"state_dict, rank0_only={rank0_only}"], _ = measure(model.state_dict)
            peaks[f"optim_state_dict, rank0_only={rank0_only}"], osd = measure(
                lambda: FSDP.optim_state_dict(model, optim)
            )
            if rank0_only:
                peaks["optim_state_dict_to_load, rank0_only"], _ = measure(
                    lambda osd=osd: FSDP.optim_state_dict_to_load(model, optim, osd)
                )
    return {
        "peaks MiB above what is kept": peaks,
        "largest tensor MiB": 4.0,
        "model MiB": sum(p.numel() * 4 for p in model.parameters()) / MiB,
    }


def test_full_state_dicts_stream_through_the_gpu_one_tensor_at_a_time():
    for rank, out in enumerate(run_ranks(full_state_peaks, _world())):
        print(f"rank {rank}: {out}")
        for name, peak in out["peaks MiB above what is kept"].items():
            # A gathered tensor and the pieces it is made of; never the 32 MiB model.
            assert peak <= 3 * out["largest tensor MiB"] + 1, (name, peak, out)


def compute_device_without_device_id() -> dict:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    on_cpu = FSDP(C.make_model(0), use_orig_params=True)
    with torch.device("meta"):
        meta_model = C.make_model(0)
    from_meta = FSDP(meta_model, use_orig_params=True)
    C.lm_loss(on_cpu, C.local_part(C.batches(0, world), rank, world).to(device)).backward()
    return {
        "expected": str(device),
        "compute_device": {str(on_cpu.compute_device), str(from_meta.compute_device)},
        "mesh": {on_cpu.device_mesh.device_type, from_meta.device_mesh.device_type},
        "shards": {str(m.embed.weight.to_local().device) for m in (on_cpu, from_meta)},
        "materialized": all(
            bool(torch.isfinite(p.to_local()).all()) for p in from_meta.parameters()
        ),
        "trained": all(p.grad is not None for p in on_cpu.parameters()),
    }


def test_cpu_and_meta_modules_without_device_id_compute_on_the_current_gpu():
    for out in run_ranks(compute_device_without_device_id, _world()):
        device = out["expected"]
        assert device.startswith("cuda:")
        assert out["compute_device"] == {device} and out["shards"] == {device}, out
        assert out["mesh"] == {"cuda"} and out["materialized"] and out["trained"], out


def sharded_tensor_with_cpu_shards() -> dict[str, bool]:
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_interactive.fsdp._sharded_tensor import to_dtensor_like

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    full = torch.arange(24.0).reshape(4, 6)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    value = empty(spec, 4, 6)
    value.local_shards()[0].tensor.copy_(full.chunk(world)[rank])
    mesh = init_device_mesh(device.type, (world,))
    out = {}
    for name, placement in (("matching layout", Shard(0)), ("other layout", Shard(1))):
        like = distribute_tensor(torch.zeros(4, 6, device=device), mesh, [placement])
        converted = to_dtensor_like(value, like)
        out[name] = converted.to_local().device == device and torch.equal(
            converted.full_tensor().cpu(), full
        )
    return out


def test_sharded_tensors_with_cpu_shards_load_over_nccl():
    for out in run_ranks(sharded_tensor_with_cpu_shards, _world()):
        assert out == {"matching layout": True, "other layout": True}


def cpu_rank_with_offload() -> dict:
    from fsdp_interactive import inspect
    from fsdp_interactive.fsdp import CPUOffload, FullStateDictConfig, StateDictType
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp._unit_state import unit_state

    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(C.make_model(0), cpu_offload=CPUOffload(offload_params=True), use_orig_params=True)
    C.lm_loss(model, C.local_part(C.batches(0, world), rank, world)).backward()
    model.clip_grad_norm_(1.0)
    with FSDP.summon_full_params(model, writeback=False):
        pass
    config = FullStateDictConfig(offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        model.state_dict()
    inspect.plain_copy(model.embed.weight)
    return {
        "cuda initialised": torch.cuda.is_initialized(),
        "pin_memory": unit_state(model).config.offload_policy.pin_memory,
        "compute_device": str(model.compute_device),
    }


def test_cpu_ranks_on_a_gpu_host_never_initialise_cuda():
    for out in run_ranks(cpu_rank_with_offload, 2, backend="gloo"):
        assert out == {"cuda initialised": False, "pin_memory": False, "compute_device": "cpu"}
