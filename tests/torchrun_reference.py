"""The unmodified torchrun scripts of ``tests/torchrun_scripts`` run under plain
``torchrun``, for the tests that compare a pool's run of them (or an exported notebook)
with it: what each rank saved (``save_state.py``: its parameters and optimizer state, as
the rank holds them) is compared bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent / "torchrun_scripts"


def torchrun(
    script: Path | str, nproc: int, *args: str, timeout: float = 300, cwd: Path | None = None
) -> str:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc script args``;
    its output. Fails the test with the output unless it exits with status 0; on a timeout
    its whole session (the launcher and its workers) is killed."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"torchrun {script} did not end in {timeout} s:\n{output}") from None
    assert process.returncode == 0, f"torchrun {script} exited with {process.returncode}:\n{output}"
    return output


def saved(folder: Path | str, world_size: int) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """What each rank of a run saved in ``folder``."""
    return {
        rank: torch.load(Path(folder) / f"rank-{rank}.pt", weights_only=True)
        for rank in range(world_size)
    }


def differences(a: Path | str, b: Path | str, world_size: int) -> list[str]:
    """Where two runs' saved states differ (empty: equal bit for bit)."""
    left, right = saved(a, world_size), saved(b, world_size)
    found = []
    for rank in range(world_size):
        for part in ("params", "optimizer"):
            x, y = left[rank][part], right[rank][part]
            if x.keys() != y.keys():
                found.append(f"rank {rank} {part}: names {sorted(x)} vs {sorted(y)}")
                continue
            found += [
                f"rank {rank} {part} {name}"
                for name in x
                if x[name].dtype != y[name].dtype or not torch.equal(x[name], y[name])
            ]
    return found


def run_exported(
    script: Path | str,
    nproc: int,
    out: Path | str,
    model: str = "model",
    optimizer: str = "optimizer",
) -> str:
    """Run the exported ``script`` under torchrun; each rank then saves what it holds under
    ``model`` and ``optimizer`` to ``out``. Its output."""
    return torchrun(SCRIPTS / "run_exported.py", nproc, str(script), str(out), model, optimizer)


def save_pool_state(
    pool, out: Path | str, model: str = "model", optimizer: str = "optimizer"
) -> None:
    """Each of ``pool``'s ranks saves what it holds under ``model`` and ``optimizer`` to
    ``out``, as ``save_state.py`` does (a call the journal does not keep)."""
    code = (
        "import runpy as _runpy\n"
        f"_runpy.run_path({str(SCRIPTS / 'save_state.py')!r})['save_state']"
        f"({str(out)!r}, rank, {model}, {optimizer})\n"
        "del _runpy\n"
    )
    pool.run(code, stream=False, journal=False)
