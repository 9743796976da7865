"""Fixtures for the multi-host tests: simulated hosts, brought up once per session.

``testhosts`` brings the hosts up (see :mod:`tests.multihost.testhosts`) when the
session runs as root with the tools installed, and brings them down at the end, also on
failure. Without them every test marked ``multihost`` is skipped with the reason; with
``FSDPI_REQUIRE_MULTIHOST=1`` (CI) it fails instead. ``FSDPI_TESTHOSTS=DIR`` names the
state directory: hosts already up there (``python -m tests.multihost.testhosts up``) are
used and left up; otherwise they are brought up in ``DIR`` and brought down afterwards.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool import Pool
from tests.multihost.testhosts import HostSet, HostSetError, environ_set, missing_tools

REQUIRE_ENV = "FSDPI_REQUIRE_MULTIHOST"


def unavailable(reason: str) -> None:
    """Skip (or, with ``FSDPI_REQUIRE_MULTIHOST=1``, fail) because the hosts are not there."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires the multi-host tests to run)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def testhosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostSet]:
    """Two simulated hosts, ``hosta`` and ``hostb``, with sshd, SLURM and OpenMPI."""
    state = os.environ.get("FSDPI_TESTHOSTS")
    if state and HostSet(state).is_up:
        yield HostSet(state)
        return
    if os.geteuid() != 0:
        unavailable("the simulated hosts need root (network namespaces and mounts)")
    missing = missing_tools()
    if missing:
        unavailable(
            "tools for the simulated hosts are missing: "
            + ", ".join(missing)
            + " (python -m tests.multihost.testhosts install)"
        )
    hosts = HostSet(state or tmp_path_factory.mktemp("testhosts"))
    try:
        hosts.up(2)
    except HostSetError as exc:
        unavailable(f"the simulated hosts could not be brought up: {exc}")
    try:
        yield hosts
    finally:
        hosts.down()


@pytest.fixture(scope="session")
def slurm_env(testhosts: HostSet) -> Iterator[dict[str, str]]:
    """``SLURM_CONF`` set in ``os.environ`` for the session.

    ipyparallel runs ``sbatch`` and ``scancel`` with the calling process's environment.
    """
    with environ_set(testhosts.slurm_env):
        yield testhosts.slurm_env


@pytest.fixture(scope="session")
def mpi_env(testhosts: HostSet) -> Iterator[dict[str, str]]:
    """OpenMPI's settings for the hosts set in ``os.environ`` for the session.

    ipyparallel runs ``mpiexec`` with the calling process's environment. Skips (fails
    under ``FSDPI_REQUIRE_MULTIHOST=1``) without mpi4py, which the engines need.
    """
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        unavailable(
            "mpi4py is not installed (pip install -e '.[mpi]', where Open MPI is); "
            "MPI engines need it"
        )
    with environ_set(testhosts.mpi_env):
        yield testhosts.mpi_env


def squeue(env: dict[str, str]) -> list[str]:
    """``JOBID STATE`` of every job in the queue."""
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i %T"],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def wait_until(condition: Callable[[], object], timeout: float) -> object:
    """Poll ``condition`` until it is truthy or ``timeout`` passes; its last value."""
    end = time.monotonic() + timeout
    value = condition()
    while not value and time.monotonic() < end:
        time.sleep(0.2)
        value = condition()
    return value


def left_on_hosts(hosts: HostSet, timeout: float = 20.0) -> dict[str, list[str]]:
    """Processes still running on any host once ``timeout`` has passed (none expected).

    ipyparallel's ssh and SLURM launchers end remote engines asynchronously, so
    processes are given ``timeout`` seconds to go.
    """

    def remaining() -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for host in hosts.hosts:
            for proc in hosts.processes_on(host.name):
                with contextlib.suppress(psutil.Error):
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        found.setdefault(host.name, []).append(
                            f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
                        )
        return found

    end = time.monotonic() + timeout
    found = remaining()
    while found and time.monotonic() < end:
        time.sleep(0.2)
        found = remaining()
    return found


@pytest.fixture(scope="module")
def private_shm(testhosts: HostSet) -> Iterator[HostSet]:
    """Every host with a ``/dev/shm`` of its own (an empty tmpfs) for the module, so that
    a pool's snapshot root on one host is not the other's, as on real hosts."""
    mounted = []
    try:
        for host in testhosts.hosts:
            testhosts.private_dir(host.name, "/dev/shm")
            mounted.append(host.name)
        yield testhosts
    finally:
        for name in mounted:
            testhosts.release_private_dir(name, "/dev/shm")


def exists_on(hosts: HostSet, host: str, path: str) -> bool:
    """Whether ``path`` exists on ``host`` (in its mount namespace)."""
    return hosts.run(host, ["test", "-e", path], check=False).returncode == 0


@contextlib.contextmanager
def running_pool(pool: Pool) -> Iterator[Pool]:
    """``pool`` started for the block and stopped afterwards, also on failure."""
    try:
        yield pool.start()
    finally:
        pool.stop()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private working directory (ipyparallel's SLURM launcher writes its batch file to '.')."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
