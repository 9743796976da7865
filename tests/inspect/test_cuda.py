"""The probes on CUDA ranks with NCCL (skipped where fewer than two GPUs are visible)."""

from __future__ import annotations

import pytest

from fsdp_interactive.pool import Pool, visible_cuda_device_count

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
