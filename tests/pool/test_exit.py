"""A pool left running when the interpreter exits is stopped, leaving no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_interactive.pool.common._logs import ENV_VAR
from fsdp_interactive.pool.processes._pids import end_processes
from tests.pool.conftest import run_script, wait_gone

SCRIPT = """
import json, sys
from fsdp_interactive.pool import Pool
pool = Pool(n=1, devices="cpu", profile_dir=sys.argv[1], show_topology=False).start()
pool.run("dist.barrier()", stream=False)
print(json.dumps(pool.launched_pids))
# no stop(): the interpreter exits with the pool running
"""


def test_interpreter_exit_stops_a_running_pool(profile_dir):
    output = run_script(SCRIPT, profile_dir)
    launched = {int(pid): created for pid, created in json.loads(output).items()}
    assert len(launched) >= 3  # controller, engine, nanny
    assert wait_gone(launched) == []


KILLED_OWNER_SCRIPT = """
import json, sys, time
from fsdp_interactive.pool import Pool
pool = Pool(n=1, devices="cpu", profile_dir=sys.argv[1], show_topology=False).start()
pool.run("dist.barrier()", stream=False)
print(json.dumps(pool.launched_pids), flush=True)
time.sleep(600)  # killed by the test while the pool runs
"""


@pytest.mark.parametrize("log_level", [None, "debug"])
def test_killed_owner_leaves_no_engine_or_controller(profile_dir, log_level):
    """SIGKILL of the kernel-like owner: no atexit runs, the orphan reaper ends the pool.

    With a log level, the reaper writes what it decided to its log file.
    """
    env = {**os.environ, ENV_VAR: log_level or ""}
    owner = subprocess.Popen(
        [sys.executable, "-c", KILLED_OWNER_SCRIPT, profile_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    launched: dict[int, float] = {}
    try:
        line = owner.stdout.readline()
        assert line, owner.stderr.read()
        launched = {int(pid): created for pid, created in json.loads(line).items()}
        assert len(launched) >= 3  # controller, engine, nanny
        owner.kill()
        owner.wait(timeout=30)
        assert wait_gone(launched, timeout=30) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=30)
        # Whatever the reaper missed is ended here, by exact pid and start time.
        end_processes(launched, grace=5)
    if log_level:
        decision = f"owner pid {owner.pid} is gone: ending its {len(launched)} recorded processes"
        # in the cluster's private log folder, log/fsdpi-<cluster id>/
        logs = [path.read_text() for path in Path(profile_dir, "log").glob("fsdpi-*/reaper-*.log")]
        assert any(decision in text for text in logs), logs
