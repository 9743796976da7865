"""CUDA/NCCL: device_id as an int, sync_module_states from a CPU module, pinned CPU offload,
torch's compression hooks unchanged, summon_full_params(offload_to_cpu). Skipped where no
CUDA device is present.

Runs ``min(2, device_count)`` NCCL ranks in spawned processes (one GPU each).
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch

from tests.fsdp import _common as C
from tests.models import Block

pytestmark = pytest.mark.cuda

STEPS = 3


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


def _checks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms._comm_hooks import default_hooks

    from fsdp_interactive.fsdp import CPUOffload, MixedPrecision
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    device = torch.device("cuda", rank)
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
            device_id=rank,
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


def _worker(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        results.put((rank, "ok", _checks(rank, world)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_fsdp_on_cuda_nccl():
    import torch.multiprocessing as mp

    world = min(2, torch.cuda.device_count())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(world, port, results), nprocs=world, start_method="spawn")
    replies = [results.get(timeout=60) for _ in range(world)]
    errors = [r for r in replies if r[1] != "ok"]
    assert not errors, errors[0][2]
    for rank, _, out in replies:
        print(f"rank {rank} (world {world}): {out}")
