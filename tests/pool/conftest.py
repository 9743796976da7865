"""Fixtures for the pool tests: one real 2-rank ipyparallel pool shared by the session.

Every process any pool starts is recorded (pid and start time); when the session ends
the shared pool is stopped and every recorded process must be gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_interactive.pool import Pool
from fsdp_interactive.pool.processes._pids import still_running

_RECORDED: dict[int, float] = {}


def record(pool: Pool) -> None:
    """Remember every process ``pool`` has started so far."""
    _RECORDED.update(pool.launched_pids)


def wait_gone(pids: dict[int, float], timeout: float = 20.0) -> list[int]:
    """Wait up to ``timeout`` for ``pids`` to end; the ones still running."""
    end = time.monotonic() + timeout
    while still_running(pids) and time.monotonic() < end:
        time.sleep(0.1)
    return still_running(pids)


def run_script(source: str, *args: str, timeout: float = 300) -> str:
    """Run ``source`` in a fresh interpreter (``python -c``) with ``args``; its stdout.

    Fails the test, with the script's stderr, unless it exits with status 0.
    """
    return run_script_streams(source, *args, timeout=timeout)[0]


def run_script_streams(
    source: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[str, str]:
    """Like :func:`run_script`, with ``env`` added to the environment; ``(stdout, stderr)``."""
    result = subprocess.run(
        [sys.executable, "-c", source, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


@pytest.fixture(scope="session")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A private ipyparallel profile directory (connection files, logs) for the session."""
    return str(tmp_path_factory.mktemp("ipython-profile"))


@pytest.fixture(scope="session")
def session_pool(profile_dir: str) -> Iterator[Pool]:
    pool = Pool(n=2, devices="cpu", profile_dir=profile_dir, show_topology=False)
    pool.interrupt_grace = 3.0
    try:
        yield pool.start()
    finally:
        record(pool)
        pool.stop()
        record(pool)
        left = wait_gone(_RECORDED)
        assert not left, f"processes left running after the pool tests: {left}"


@pytest.fixture
def pool(session_pool: Pool) -> Pool:
    """The shared 2-rank pool, running and healthy (restarted if a test broke it)."""
    if not session_pool.running or session_pool.needs_restart or session_pool.busy_ranks():
        session_pool.restart()
    record(session_pool)
    return session_pool


@pytest.fixture
def marker_dir(tmp_path: Path) -> Path:
    """A directory ranks and test threads use to tell each other where they are."""
    os.chmod(tmp_path, 0o700)
    return tmp_path


@pytest.fixture(scope="session")
def unattached_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The final parameters of ``tests/pool/attach_train.py --steps 9`` on 2 ranks, run
    plainly (no attachable module): what every attached run of those steps must end with,
    bit for bit (its other options, a hold or a sleep, change no number)."""
    from tests.pool.attach_jobs import TorchrunJob

    folder = tmp_path_factory.mktemp("unattached")
    out = folder / "plain.pt"
    with TorchrunJob(folder, 2, "--steps", "9", "--out", str(out), attachable=False) as job:
        assert job.wait() == 0, job.output()
    return out
