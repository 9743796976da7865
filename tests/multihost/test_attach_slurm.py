"""Attaching to an sbatch job on the simulated SLURM hosts from a notebook on another host.

The job runs one attachable rank on each of ``hosta`` and ``hostb`` (``srun``), its attach
dir a folder of each host's own (a tmpfs neither the other host nor the head sees). The
notebook, a process on ``hostb``, names only the SLURM job id: it finds the nodes with
``squeue``, reads rank 1's record on its own host and rank 0's on ``hosta`` over ssh,
reaches rank 0 through an ssh tunnel, and sees status and stacks, pauses both ranks after
the same step, reads the gradient norm and checks it against ``clip_grad_norm_``, resumes
and detaches; the job then ends normally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multihost.conftest import squeue, wait_until
from tests.pool.attach_jobs import SCRIPT

pytestmark = pytest.mark.multihost

_NOTEBOOK = """
import json, socket, sys, time
import fsdp_interactive
from fsdp_interactive.notebook.rank_model import RankModel
job_id, attach_dir, ssh_config = sys.argv[1:4]
job = fsdp_interactive.attach(job_id, attach_dir=attach_dir, ssh_args=["-F", ssh_config])
try:
    status = job.status()
    while min(s.step for s in status.states.values()) < 2:  # training, past its imports
        time.sleep(0.1)
        status = job.status()
    stacks, where = job.stacks()
    step = job.pause(timeout=120)
    paused = [s.phase for s in job.status().states.values()]
    norm = RankModel(job, "model").grad_norms().total
    job.run(
        "import torch\\n_total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)\\n"
        "_total = float(_total.full_tensor() if hasattr(_total, 'full_tensor') else _total)",
        stream=False,
    )
    reference = job.pull("_total")[0]
    tunnels = len(job._links._tunnels)
    job.resume()
finally:
    job.detach()
print(json.dumps({
    "here": socket.gethostname(),
    "hosts": {r: s.host for r, s in status.states.items()},
    "stacks": stacks,
    "step": step,
    "paused": paused,
    "norm": norm,
    "reference": reference,
    "tunnels": tunnels,
}))
"""


def _batch(folder: Path, attach_dir: str, stop: Path) -> str:
    rank = (
        f"RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec {sys.executable} "
        f"-m fsdp_interactive.attachable --attach-dir {attach_dir} {SCRIPT} --stop-file {stop} "
        "--step-sleep 0.05"
    )
    return "\n".join(
        [
            "#!/bin/sh",
            "#SBATCH --job-name=attachable",
            "#SBATCH --nodes=2",
            "#SBATCH --ntasks=2",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --output={folder / 'job.out'}",
            "#SBATCH --export=ALL",
            "export MASTER_ADDR=hosta MASTER_PORT=29517",
            f"srun sh -c '{rank}'",
            "",
        ]
    )


def test_a_notebook_on_another_host_attaches_to_an_sbatch_job_by_its_id(
    testhosts, slurm_env, tmp_path
):
    os.chmod(tmp_path, 0o700)
    private = tmp_path / "host-only"
    for host in ("hosta", "hostb"):
        testhosts.private_dir(host, private)
    attach_dir = str(private / "attach")
    stop = tmp_path / "stop"
    batch = tmp_path / "job.sh"
    batch.write_text(_batch(tmp_path, attach_dir, stop))
    notebook = tmp_path / "notebook.py"
    notebook.write_text(_NOTEBOOK)
    env = dict(os.environ, **slurm_env)
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(batch)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        assert wait_until(lambda: f"{job_id} RUNNING" in squeue(slurm_env), 120), squeue(slurm_env)

        def records_on_both() -> bool:
            found = [
                testhosts.run(
                    host,
                    ["sh", "-c", f"ls {attach_dir}/slurm-{job_id}.0/ 2>/dev/null"],
                    check=False,
                ).stdout
                for host in ("hosta", "hostb")
            ]
            return all("rank-" in listing for listing in found)

        assert wait_until(records_on_both, 180), (tmp_path / "job.out").read_text(errors="replace")
        assert not os.path.exists(attach_dir)  # the head sees neither host's folder
        done = testhosts.run(
            "hostb",
            [sys.executable, str(notebook), job_id, attach_dir, testhosts.ssh_config],
            timeout=300,
            check=False,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        stop.touch()
    assert seen["here"] == "hostb" and seen["hosts"] == {"0": "hosta", "1": "hostb"}
    assert seen["tunnels"] == 1  # rank 0 through ssh; rank 1 on the notebook's host
    assert all('attach_train.py", line' in text for text in seen["stacks"].values())
    assert seen["paused"] == ["paused", "paused"] and seen["step"] >= 1
    assert seen["norm"] == pytest.approx(seen["reference"], rel=1e-6)
    assert wait_until(lambda: squeue(slurm_env) == [], 120), squeue(slurm_env)
    assert "Traceback" not in (tmp_path / "job.out").read_text(errors="replace")
    for host in ("hosta", "hostb"):
        testhosts.release_private_dir(host, private)
