"""A notebook session exported with ``--sbatch --nodes 2`` runs as a SLURM job on the two
simulated hosts (``srun torchrun``, a c10d rendezvous on the first node), one rank on each,
and its ranks print the notebook's checksums bit for bit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fsdp_interactive.pool import Pool
from tests.multihost.conftest import squeue, wait_until

pytestmark = pytest.mark.multihost

SESSION = [
    """
import torch.nn.functional as F
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
torch.manual_seed(0)
model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
optimizer = torch.optim.Adam(model.parameters(), lr=lr)
""",
    """
for step in range(3):
    x = torch.randn(4, 8)
    F.mse_loss(model(x), torch.zeros(4, 4)).backward()
    optimizer.step()
    optimizer.zero_grad()
""",
    """
import hashlib
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.detach().to_local().numpy().tobytes())
for state in optimizer.state.values():
    for value in state.values():
        digest.update(getattr(value, "to_local", lambda: value)().numpy().tobytes())
print(f"checksum rank {rank}: {digest.hexdigest()}")
""",
]


def test_exported_sbatch_file_runs_on_the_slurm_hosts_and_reproduces_the_state(
    testhosts, slurm_env, workdir: Path, tmp_path_factory
):
    pool = Pool(
        2,
        devices="cpu",
        profile_dir=str(tmp_path_factory.mktemp("export-profile")),
        show_topology=False,
    )
    try:
        pool.start()
        pool.push({"lr": 1e-2})
        for number, code in enumerate(SESSION, start=1):
            out = pool.run(code, cell=number, stream=False).stdout
        plan = pool.export(workdir / "job.py", sbatch=True, nodes=2, gpus_per_node=1)
    finally:
        pool.stop()
    notebook = sorted(line for text in out.values() for line in text.splitlines())
    assert plan.sbatch is not None and plan.layout.world_size == 2 and not plan.notes

    submitted = subprocess.run(
        ["sbatch", "--parsable", "-p", testhosts.slurm_partition, plan.sbatch],
        cwd=workdir,
        env=dict(os.environ, **slurm_env),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]
    try:
        gone = wait_until(lambda: not any(j.startswith(f"{job} ") for j in squeue(slurm_env)), 300)
    finally:
        subprocess.run(["scancel", job], env=dict(os.environ, **slurm_env), timeout=30)
    output = (workdir / f"job-{job}.out").read_text()
    assert gone, f"job {job} still queued or running:\n{output}"
    printed = sorted(line for line in output.splitlines() if line.startswith("checksum rank"))
    assert printed == notebook, output
