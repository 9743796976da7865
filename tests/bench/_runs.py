"""Running a bench module as a user would: ``python -m ...`` from the repository root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_module(args: list[str], timeout: float) -> tuple[int, str]:
    """``python -m *args`` in the repository root, in a session of its own; returns its
    exit status and output (stdout and stderr together). Past ``timeout`` seconds the
    session is killed (so are the ranks it started) and the test fails with the output's
    tail."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(
            f"python -m {' '.join(args)} did not finish in {timeout:.0f} s:\n{output[-4000:]}"
        )
    return proc.returncode, output
