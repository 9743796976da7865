"""A pool left running when the interpreter exits is stopped, leaving no process behind."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.pool.conftest import wait_gone

SCRIPT = """
import json, sys
from fsdp_interactive.pool import Pool
pool = Pool(n=1, devices="cpu", profile_dir=sys.argv[1], show_topology=False).start()
pool.run("dist.barrier()", stream=False)
print(json.dumps(pool.launched_pids))
# no stop(): the interpreter exits with the pool running
"""


def test_interpreter_exit_stops_a_running_pool(profile_dir):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, profile_dir],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    launched = {int(pid): created for pid, created in json.loads(result.stdout).items()}
    assert len(launched) >= 3  # controller, engine, nanny
    assert wait_gone(launched) == []
