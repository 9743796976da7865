"""Relaunching a script with torchrun: the baseline an interactive pool replaces.

:func:`relaunch` runs ``python -m torch.distributed.run --standalone --nproc-per-node N
<script>`` once and reports two times measured from just before the launch:

* ``ready_s``: when rank 0 printed ``READY <unix time>`` (the process group became usable,
  see ``bench/scripts/noop_rank.py``);
* ``total_s``: when the launcher exited (what a user waits for per relaunch).

:func:`death_latency` launches ``bench/scripts/wait_rank.py`` the same way, kills its
last rank with SIGKILL once every rank is up, and times how long the launcher takes to
notice and exit (its agent polls its workers every ``--monitor-interval``, 0.1 s by
default, then stops the others).

The launcher runs in its own session; if it fails or overruns ``timeout``, exactly that
session (the launcher and the workers it started) is terminated, then killed.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOOP_SCRIPT = Path(__file__).resolve().parent / "scripts" / "noop_rank.py"
FSDP_READY_SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp_ready_rank.py"
WAIT_SCRIPT = Path(__file__).resolve().parent / "scripts" / "wait_rank.py"


@dataclass
class Relaunch:
    ready_s: float
    total_s: float


def launch(
    world_size: int,
    script: Path,
    stderr: Any = subprocess.PIPE,
    backend: str = "gloo",
    *,
    torchrun_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node=world_size [torchrun_args] script`` in its
    own session, one intra-op thread per rank, stdout piped (text); ``extra_env`` is added
    to this process's environment."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        *torchrun_args,
        str(script),
    ]
    # The scripts read the backend from BENCH_BACKEND (nccl: one CUDA device per rank).
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        BENCH_BACKEND=backend,
        **(extra_env or {}),
    )
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        start_new_session=True,
    )


def relaunch(
    world_size: int, script: Path = NOOP_SCRIPT, timeout: float = 120.0, backend: str = "gloo"
) -> Relaunch:
    """Launch ``script`` on ``world_size`` local ranks with torchrun and time it."""
    start_wall = time.time()
    start = time.perf_counter()
    proc = launch(world_size, script, backend=backend)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_session(proc)
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


def death_latency(world_size: int, timeout: float = 120.0) -> float:
    """Seconds from SIGKILL of the last rank to the torchrun launcher's exit."""
    # The launcher's report goes to a file: no thread needs to drain it.
    with tempfile.TemporaryFile("w+") as errors:
        proc = launch(world_size, WAIT_SCRIPT, stderr=errors)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, name="torchrun-stdout", daemon=True)
        reader.start()
        try:
            pids = _ready_pids(world_size, lines, errors, timeout)
            start = time.perf_counter()
            os.kill(pids[world_size - 1], signal.SIGKILL)
            proc.wait(timeout=timeout)
            latency = time.perf_counter() - start
        finally:
            stop_session(proc)
            reader.join(timeout=10)
    if proc.returncode == 0:
        raise RuntimeError("torchrun exited with status 0 after one of its ranks was killed")
    return latency


_READY_LINE = re.compile(r"READY (\d+) (\d+)")


def _ready_pids(
    world_size: int, lines: queue.Queue[str | None], errors: Any, timeout: float
) -> dict[int, int]:
    """Rank -> pid from the ranks' ``READY <rank> <pid>`` lines."""
    pids: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(pids) < world_size:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(
                f"torchrun of {WAIT_SCRIPT.name}: {len(pids)} of {world_size} ranks ready "
                f"after {timeout:.0f}s"
            ) from None
        if line is None:
            errors.seek(0)
            raise RuntimeError(
                f"torchrun of {WAIT_SCRIPT.name} exited before every rank was up:\n"
                + errors.read()[-3000:]
            )
        for rank, pid in _READY_LINE.findall(line):
            pids[int(rank)] = int(pid)
    return pids


def stop_session(proc: subprocess.Popen) -> None:
    """End the session ``proc`` leads (a launcher started with ``start_new_session``, and
    the workers it started): SIGTERM, then SIGKILL; nothing when it is already gone."""
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
