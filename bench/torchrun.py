"""Relaunching a script with torchrun: the baseline an interactive pool replaces.

:func:`relaunch` runs ``python -m torch.distributed.run --standalone --nproc-per-node N
<script>`` once and reports two times measured from just before the launch:

* ``ready_s``: when rank 0 printed ``READY <unix time>`` (the process group became usable,
  see ``bench/scripts/noop_rank.py``);
* ``total_s``: when the launcher exited (what a user waits for per relaunch).

The launcher runs in its own session; if it fails or overruns ``timeout``, exactly that
session (the launcher and the workers it started) is terminated, then killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NOOP_SCRIPT = Path(__file__).resolve().parent / "scripts" / "noop_rank.py"


@dataclass
class Relaunch:
    ready_s: float
    total_s: float


def relaunch(world_size: int, script: Path = NOOP_SCRIPT, timeout: float = 120.0) -> Relaunch:
    """Launch ``script`` on ``world_size`` local ranks with torchrun and time it."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        str(script),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start_wall = time.time()
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_session(proc)
        raise TimeoutError(f"torchrun of {script.name} did not finish in {timeout:.0f}s") from None
    total = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun of {script.name} exited with {proc.returncode}:\n{stderr[-3000:]}"
        )
    ready_lines = [line for line in stdout.splitlines() if line.startswith("READY ")]
    if not ready_lines:
        raise RuntimeError(f"torchrun of {script.name} never printed READY:\n{stdout[-2000:]}")
    ready = float(ready_lines[0].split()[1]) - start_wall
    return Relaunch(ready_s=ready, total_s=total)


def _stop_session(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
