"""Bad arguments fail early and clearly, and a failed start leaves nothing running."""

from __future__ import annotations

import sys

import pytest
from traitlets.config import Config

from fsdp_interactive.pool import Pool, PoolNotRunning, PoolStartError, visible_cuda_device_count
from fsdp_interactive.pool.processes._pids import still_running
from tests.pool.conftest import record, wait_gone


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be an integer >= 1"),
        ({"n": -2}, "n must be an integer >= 1"),
        ({"n": "2"}, "n must be an integer >= 1"),
        ({"n": True}, "n must be an integer >= 1"),
        ({"devices": [-1]}, "non-negative CUDA device indices"),
        ({"devices": [0, 0]}, "must not repeat"),
        ({"devices": "gpu"}, "list of CUDA device indices or 'cpu'"),
        ({"devices": []}, "non-negative CUDA device indices"),
        ({"n": 3, "devices": [0, 1]}, "n=3 ranks but only 2 devices"),
        ({"n": 1, "devices": [0, 1]}, "pass as many devices as ranks"),
        ({"backend": "mpi"}, "backend must be 'nccl', 'gloo' or None"),
        ({"backend": "nccl", "devices": "cpu"}, "needs CUDA devices"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"pg_timeout": -1}, "pg_timeout must be a positive number"),
        ({"engines": ""}, "engines must be a launcher name"),
    ],
)
def test_bad_arguments_are_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Pool(**kwargs)


@pytest.mark.skipif(visible_cuda_device_count() > 0, reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"devices": [0]}, r"devices \[0\] not present: 0 CUDA device"),
        ({"backend": "nccl"}, "needs CUDA devices, but none are visible"),
    ],
)
def test_missing_devices_are_rejected_before_anything_starts(kwargs, message):
    pool = Pool(**kwargs)
    with pytest.raises(ValueError, match=message):
        pool.start()
    assert pool.launched_pids == {}
    assert pool.state == "stopped"


def test_calls_on_a_pool_that_is_not_running_say_so():
    pool = Pool(n=2, devices="cpu")
    with pytest.raises(PoolNotRunning, match=r"call pool\.start"):
        pool.run("1")
    assert pool.topology == []
    pool.stop()  # stopping a pool that never started is a no-op


def _engines_that(command: str) -> Config:
    config = Config()
    config.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-c", command]
    return config


def test_engines_that_never_register_time_out_and_are_stopped(profile_dir):
    pool = Pool(
        n=2,
        devices="cpu",
        timeout=4,
        profile_dir=profile_dir,
        config=_engines_that("import time; time.sleep(300)"),
    )
    with pytest.raises(PoolStartError, match=r"only 0 of 2 engines registered within timeout=4s"):
        pool.start()
    record(pool)
    assert len(pool.launched_pids) >= 3  # controller and both engines were started
    assert pool.state == "stopped"
    assert wait_gone(pool.launched_pids) == []


_DIES_WHEN_DESCRIBED = """
import os, sys
from fsdp_interactive.pool.common import _hosts

def _dies(*args, **kwargs):
    os.write(2, b"engine gives up while describing itself\\n")  # its log, not the request's
    os._exit(7)

_hosts.versions = _dies  # first called when the pool asks the engine to describe itself
from ipyparallel.engine.app import main
sys.exit(main())
"""


def test_an_engine_that_exits_after_registering_is_reported_with_its_status_and_log(
    profile_dir,
):
    pool = Pool(
        n=2, devices="cpu", timeout=60, profile_dir=profile_dir,
        config=_engines_that(_DIES_WHEN_DESCRIBED),
    )  # fmt: skip
    with pytest.raises(PoolStartError, match=r"exited while describing engines") as info:
        pool.start()
    record(pool)
    assert "(exit code 7)" in str(info.value)
    assert "engine gives up while describing itself" in str(info.value)
    assert pool.state == "stopped"
    assert still_running(pool.launched_pids) == [] or wait_gone(pool.launched_pids) == []


def test_engines_that_exit_at_start_are_reported_with_their_log(profile_dir):
    pool = Pool(
        n=2,
        devices="cpu",
        timeout=60,
        profile_dir=profile_dir,
        config=_engines_that("print('engine cannot start: no torch here'); raise SystemExit(3)"),
    )
    with pytest.raises(PoolStartError, match="exited before registering") as info:
        pool.start()
    record(pool)
    assert "engine cannot start: no torch here" in str(info.value)
    assert still_running(pool.launched_pids) == [] or wait_gone(pool.launched_pids) == []
