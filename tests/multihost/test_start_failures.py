"""Pools across hosts that cannot start: the error comes as soon as the launcher knows,
with what the launcher and the engines said, and nothing is left behind.

None of these waits for its start-up timeout: each error is the one raised when the
launcher has told the pool that no more engines can register ("... no more can"), which
the timeout's error ("only N of M engines registered within timeout=...") is not.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from traitlets.config import Config

from fsdp_interactive.pool import Pool, PoolStartError
from tests.multihost.conftest import left_on_hosts, squeue, wait_until
from tests.multihost.launchers import (
    mpi_pool_kwargs,
    slurm_batch_template,
    slurm_pool_kwargs,
    ssh_pool_kwargs,
)

pytestmark = pytest.mark.multihost

#: Long enough that an error raised at the timeout reads differently (see the docstring).
START_TIMEOUT = 240


def test_mpi_engines_that_crash_before_registering_fail_the_start_with_their_output(
    testhosts, mpi_env, tmp_path_factory
):
    # The ranks' Python finds an mpi4py that cannot be imported, as on a host without it.
    shadow = tmp_path_factory.mktemp("no-mpi4py")
    (shadow / "mpi4py").mkdir()
    (shadow / "mpi4py" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mpi4py'\", name='mpi4py')\n"
    )
    profile_dir = str(tmp_path_factory.mktemp("mpi-crash-profile"))
    kwargs = mpi_pool_kwargs(testhosts, 1, profile_dir)
    launcher_config = kwargs["config"]["MPILauncher"]
    launcher_config["mpi_args"] = [*launcher_config["mpi_args"], "-x", f"PYTHONPATH={shadow}"]
    pool = Pool(2, devices="cpu", timeout=START_TIMEOUT, show_topology=False, **kwargs)
    with pytest.raises(PoolStartError) as caught:
        pool.start()
    message = str(caught.value)
    assert "no more can" in message, message
    assert "engine launcher (mpiexec) exited with status" in message, message
    assert "No module named 'mpi4py'" in message, message
    assert left_on_hosts(testhosts) == {}


def test_a_slurm_job_that_can_never_run_fails_the_start_with_its_queue_state(
    testhosts, slurm_env, workdir, tmp_path_factory
):
    profile_dir = str(tmp_path_factory.mktemp("slurm-never-profile"))
    kwargs = slurm_pool_kwargs(testhosts, 1, profile_dir)
    # three nodes asked of a partition of two: sbatch accepts it, it pends forever
    kwargs["config"] = Config(
        {"SlurmEngineSetLauncher": {"batch_template": slurm_batch_template(3, 1)}}
    )
    pool = Pool(3, devices="cpu", timeout=START_TIMEOUT, show_topology=False, **kwargs)
    with pytest.raises(PoolStartError) as caught:
        pool.start()
    message = str(caught.value)
    assert "no more can" in message, message
    assert "squeue shows it PENDING (Partition" in message, message  # ...NodeLimit or ...Config
    job = message.split("SLURM job ", 1)[1].split()[0]
    assert f"scancel {job}" in message
    assert wait_until(lambda: squeue(slurm_env) == [], 60), squeue(slurm_env)


def test_a_slurm_job_that_stays_pending_times_out_with_its_queue_state(
    testhosts, slurm_env, workdir, tmp_path_factory
):
    # Another job holds both nodes for the whole test.
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--exclusive", "-N2", "-p", testhosts.slurm_partition,
         "-o", "/dev/null", "--wrap", "sleep 600"],
        capture_output=True, text=True, check=True, timeout=30, cwd=workdir,
    ).stdout.strip().split(";")[0]  # fmt: skip
    try:
        assert wait_until(lambda: f"{blocker} RUNNING" in squeue(slurm_env), 30)
        profile_dir = str(tmp_path_factory.mktemp("slurm-pending-profile"))
        pool = Pool(
            2, devices="cpu", timeout=10, show_topology=False,
            **slurm_pool_kwargs(testhosts, 1, profile_dir),
        )  # fmt: skip
        with pytest.raises(PoolStartError) as caught:
            pool.start()
        message = str(caught.value)
        assert "within timeout=10s" in message, message
        assert "is PENDING (Resources) in squeue" in message, message
        job = message.split("SLURM job ", 1)[1].split()[0]
        assert f"scancel {job}" in message
        assert wait_until(lambda: squeue(slurm_env) == [f"{blocker} RUNNING"], 60)
    finally:
        subprocess.run(["scancel", blocker], check=False, timeout=30)
    assert wait_until(lambda: squeue(slurm_env) == [], 60), squeue(slurm_env)
    assert left_on_hosts(testhosts) == {}


def test_a_controller_ip_that_is_not_this_hosts_is_refused_before_anything_starts(
    testhosts, tmp_path
):
    with pytest.raises(
        ValueError, match=r"controller_ip='198\.18\.\d+\.\d+' is not an address of this host"
    ):
        Pool(2, devices="cpu", engines="slurm", controller_ip=testhosts.unused_address)
    assert not list(Path(tmp_path).iterdir())


def test_ssh_hosts_unreachable_or_without_the_package_are_named_before_any_engine_starts(
    testhosts, tmp_path_factory
):
    profile_dir = str(tmp_path_factory.mktemp("ssh-refused-profile"))
    kwargs = ssh_pool_kwargs(testhosts, 1, profile_dir)
    section = kwargs["config"]["SSHEngineSetLauncher"]
    # hostb's system Python has neither torch nor fsdp_interactive; nobody answers at the
    # unused address
    section["engines"] = {
        "hosta": 1,
        "hostb": {"n": 1, "remote_python": "/usr/bin/python3"},
        testhosts.unused_address: 1,
    }
    pool = Pool(3, devices="cpu", timeout=START_TIMEOUT, show_topology=False, **kwargs)
    with pytest.raises(PoolStartError) as caught:
        pool.start()
    message = str(caught.value)
    assert "no engine was started" in message, message
    assert "hosta" not in message, message
    assert "hostb: torch not installed there, " in message, message
    assert "fsdp-interactive not installed there" in message, message
    assert f"{testhosts.unused_address}: cannot run its remote_python over ssh" in message
    assert left_on_hosts(testhosts) == {}
