"""The pool's snapshot root on this host: handed to every rank, kept while the engine
forker lives (across restarts and a rank's death), removed by stop() and, when the kernel
is killed, by the forker and the orphan reaper."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool import Pool, RankDied
from fsdp_interactive.pool.common._snapshot_root import ENV_VAR, create_root, remove_root
from fsdp_interactive.pool.processes._pids import end_processes, start_time, still_running
from tests.pool.conftest import record, wait_gone

#: What a snapshot leaves in the root, as far as these tests care.
WRITE_SNAPSHOT = (
    "import os\n"
    "os.makedirs(os.path.join(os.environ['FSDPI_SNAPSHOT_ROOT'], 's000001'), exist_ok=True)\n"
    "open(os.path.join(os.environ['FSDPI_SNAPSHOT_ROOT'], 's000001', f'rank{rank}'), 'w')"
    ".close()\n"
)


def _forkers(pool: Pool) -> set[int]:
    return {psutil.Process(r.pid).ppid() for r in pool.topology}


def test_remove_root_removes_only_a_pools_private_snapshot_root(tmp_path):
    root = tmp_path / "fsdpi-0123456789ab"
    assert create_root(str(root)) == "created"
    (root / "s000001").mkdir()
    assert remove_root(str(root)) is True and not root.exists()
    assert remove_root(str(root)) is False  # gone already
    with pytest.raises(ValueError, match="not a pool's snapshot root"):
        remove_root(str(tmp_path))
    assert tmp_path.exists()
    # A folder at the path that is not a private folder of this user is left alone.
    shared = tmp_path / "fsdpi-shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert remove_root(str(shared)) is False and shared.exists()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "fsdpi-link").symlink_to(target)
    assert remove_root(str(tmp_path / "fsdpi-link")) is False and target.exists()


def test_ranks_share_the_pools_root_which_restart_keeps_and_stop_removes(profile_dir):
    pool = Pool(n=2, devices="cpu", profile_dir=profile_dir, show_topology=False)
    root = Path(pool.snapshot_root)
    assert root.name.startswith("fsdpi-") and not root.exists()
    try:
        pool.start()
        record(pool)
        seen = pool.run(f"import os; os.environ[{ENV_VAR!r}]", stream=False).results
        assert seen == {0: repr(str(root)), 1: repr(str(root))}
        pool.run(WRITE_SNAPSHOT, stream=False)
        assert sorted(p.name for p in (root / "s000001").iterdir()) == ["rank0", "rank1"]
        pool.restart()
        record(pool)
        assert pool.snapshot_root == str(root)  # one root for the life of the Pool
        assert (root / "s000001" / "rank1").exists()
    finally:
        pool.stop()
        record(pool)
    assert not root.exists()
    assert wait_gone(pool.launched_pids) == []


def test_a_killed_rank_leaves_the_forker_and_the_root_for_the_next_group(profile_dir):
    pool = Pool(n=2, devices="cpu", profile_dir=profile_dir, show_topology=False)
    root = Path(pool.snapshot_root)
    try:
        pool.start()
        record(pool)
        (forker,) = _forkers(pool)
        pool.run(WRITE_SNAPSHOT, stream=False)
        old = {r.pid: start_time(r.pid) for r in pool.topology}
        victim = pool.topology[1].pid
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        with pytest.raises(RankDied) as died:
            pool.run("import time\nwhile True:\n    time.sleep(0.05)", stream=False)
        assert died.value.exit_codes[1] == -signal.SIGKILL
        assert wait_gone(old, timeout=60) == []  # the broken group is torn down...
        assert pool.state == "broken"
        assert psutil.Process(forker).is_running()  # ...and its forker kept
        assert forker in still_running(pool.launched_pids)
        assert (root / "s000001" / "rank0").exists()  # a rank's death frees no snapshot
        pool.restart()
        record(pool)
        assert _forkers(pool) == {forker}  # the new group forked from the kept forker
        assert (root / "s000001" / "rank1").exists()
    finally:
        pool.stop()
        record(pool)
    assert not root.exists()
    assert wait_gone(pool.launched_pids) == []


KILLED_KERNEL = """
import json, sys, time
from fsdp_interactive.pool import Pool
pool = Pool(n=2, devices="cpu", profile_dir=sys.argv[1], show_topology=False).start()
pool.run(sys.argv[2], stream=False)
print(json.dumps({"root": pool.snapshot_root, "pids": pool.launched_pids,
                  "state": pool._processes._state_dir}), flush=True)
time.sleep(600)  # killed by the test while the pool runs
"""


def test_a_killed_kernel_leaves_no_snapshot_root(profile_dir):
    kernel = subprocess.Popen(
        [sys.executable, "-c", KILLED_KERNEL, profile_dir, WRITE_SNAPSHOT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    launched: dict[int, float] = {}
    try:
        line = kernel.stdout.readline()
        assert line, kernel.stderr.read()
        report = json.loads(line)
        launched = {int(pid): created for pid, created in report["pids"].items()}
        root = Path(report["root"])
        assert (root / "s000001" / "rank1").exists()
        kernel.kill()
        kernel.wait(timeout=30)
        assert wait_gone(launched, timeout=30) == []
        end = time.monotonic() + 30
        state = Path(report["state"])  # where the reaper's list was kept
        while (root.exists() or state.exists()) and time.monotonic() < end:
            time.sleep(0.1)
        assert not root.exists()
        assert not state.exists()
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait(timeout=30)
        end_processes(launched, grace=5)


def test_the_reaper_removes_the_root_when_the_owner_dies(tmp_path):
    """Also when the forker was SIGKILLed and could not remove the root itself."""
    root = tmp_path / "fsdpi-reaper-test"
    create_root(str(root))
    (root / "s000001").mkdir()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    victim = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    pid_file = tmp_path / "launched.json"
    pid_file.write_text(json.dumps({str(victim.pid): start_time(victim.pid)}))
    command = [
        sys.executable,
        "-m",
        "fsdp_interactive.pool.processes._reaper",
        str(owner.pid),
        repr(start_time(owner.pid)),
        str(pid_file),
    ]
    reaper = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
    reaper.stdin.write(json.dumps({"remove": [str(root)]}).encode())  # never on its command line
    reaper.stdin.close()
    try:
        time.sleep(1.5)  # it watches: nothing happens while the owner lives
        assert root.exists() and victim.poll() is None
        owner.kill()
        owner.wait(30)
        assert reaper.wait(60) == 0
        assert victim.wait(30) == -signal.SIGTERM
        assert not root.exists()
    finally:
        for proc in (owner, victim, reaper):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
