"""The probes on CUDA ranks with NCCL (skipped where no GPU is visible; the pool test where
fewer than two are): values pulled to the kernel hold only plain CPU tensors, and the
summon statistics of shards kept on the GPU or offloaded to the CPU."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from fsdp_interactive.pool import Pool, visible_cuda_device_count
from tests.device_standins import tensors_pickled

pytestmark = pytest.mark.cuda

SETUP = """
from tests.models import Tiny, tiny_batch
import copy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
reference = Tiny().to(device)
model = copy.deepcopy(reference)
fully_shard(model, mesh=init_device_mesh("cuda", (world_size,)))
x, y = (t.to(device) for t in tiny_batch())
for m in (model, reference):
    torch.nn.functional.mse_loss(m(x), y).backward()
import fsdp_interactive.inspect as probes
norms = probes.grad_norms(model)
ref_total = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
stats = probes.summon_stats(model, "embed.weight")
ref_mean = float(reference.embed.weight.double().mean())
mem = probes.memory()
pulled = probes.plain_copy(model.embed.weight)
"""


@pytest.mark.skipif(visible_cuda_device_count() < 2, reason="needs 2 CUDA devices")
def test_probes_on_nccl_ranks():
    pool = Pool(n=2, show_topology=False).start()
    try:
        pool.run(SETUP, stream=False)
        for norms, ref_total, stats, ref_mean, mem, pulled in zip(
            *(
                pool.pull(name)
                for name in ("norms", "ref_total", "stats", "ref_mean", "mem", "pulled")
            ),
            strict=True,
        ):
            assert norms.total == pytest.approx(ref_total, rel=1e-5)
            assert stats.mean == pytest.approx(ref_mean, rel=1e-9)
            assert mem.device.startswith("cuda") and mem.allocated_bytes > 0
            assert pulled.device.type == "cpu" and tuple(pulled.shape) == (3, 5)
    finally:
        pool.stop()


Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Record:
    values: torch.Tensor


def test_cpu_copy_of_cuda_values_holds_only_plain_cpu_tensors():
    from fsdp_interactive._plain import cpu_copy

    value = {
        "tensor": torch.ones(2, device="cuda"),
        "pair": Pair(torch.zeros(1, device="cuda"), 1),
        "record": Record(torch.arange(3.0, device="cuda")),
        "set": {torch.ones(1, device="cuda")},
        "parameter": torch.nn.Parameter(torch.ones(2, device="cuda")),
    }
    assert {d for _, d in tensors_pickled(value)} == {"cuda"}
    copy = cpu_copy(value)
    assert set(tensors_pickled(copy)) == {(torch.Tensor, "cpu")}
    assert copy["record"].values.tolist() == [0.0, 1.0, 2.0]


def probes_of_an_offloaded_model() -> dict:
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import fsdp_interactive.inspect as probes
    from tests.models import Tiny, tiny_batch

    nccl = dist.get_backend() == "nccl"  # gloo: a dry run of this test's plumbing on CPU
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    torch.manual_seed(0)
    reference = Tiny().to(device)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    offload = CPUOffloadPolicy(pin_memory=nccl)
    fully_shard(model.block, mesh=mesh, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)
    x, y = (t.to(device) for t in tiny_batch())
    for m in (model, reference):
        torch.nn.functional.mse_loss(m(x), y).backward()
    norms = probes.grad_norms(model)
    ref_total = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
    pulled = probes.plain_copy({"w": model.embed.weight, "grads": [model.embed.weight.grad]})
    return {
        "offloaded": model.embed.weight.to_local().device.type == "cpu",
        "grad norm": abs(norms.total - ref_total) <= 1e-5 * ref_total,
        "pulled weight": torch.equal(pulled["w"], reference.embed.weight.detach().cpu()),
        "pulled grad": torch.allclose(pulled["grads"][0], reference.embed.weight.grad.cpu()),
        "plain cpu": set(tensors_pickled(pulled)) == {(torch.Tensor, "cpu")},
    }


def test_probes_of_a_cpu_offloaded_model_on_nccl():
    from tests.cuda_ranks import run_ranks

    for out in run_ranks(probes_of_an_offloaded_model, min(2, torch.cuda.device_count())):
        assert all(out.values()), out


def test_summon_stats_of_kept_and_offloaded_shards_on_nccl():
    """Statistics and edits of shards on the GPU and offloaded to the CPU; one GPU suffices
    (tests/inspect/test_summon_stats_sharded.py runs the same check on gloo ranks)."""
    from tests.cuda_ranks import run_ranks
    from tests.inspect._full_stats import stats_of_kept_and_offloaded_shards

    world = min(2, torch.cuda.device_count())
    for calls in run_ranks(stats_of_kept_and_offloaded_shards, world):
        assert set(calls) == {"kept", "offloaded", "wrapper offloaded"}, calls
