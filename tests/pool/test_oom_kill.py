"""A rank killed by the kernel's OOM killer is reported as out of memory, not only as
SIGKILL: a real pool whose processes run in a memory cgroup of their own, made for the
test under this process's own, with a limit that one rank's allocation passes.

Needs a writable memory cgroup (cgroup v1's ``memory`` controller or v2's ``memory.max``);
without one the test is skipped, unless ``FSDPI_REQUIRE_OOM=1`` makes that a failure.
The records themselves (a cgroup's counter, the kernel log) are also read from files the
test writes, so that each is shown to be enough on its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_interactive.pool.diagnostics import _oom
from tests.pool.conftest import run_script_streams

_OOM_SCRIPT = """
import os, sys
from pathlib import Path
cgroup = Path(sys.argv[1])
(cgroup / "cgroup.procs").write_text(str(os.getpid()))  # the pool's processes follow
from fsdp_interactive.pool import Pool, RankDied
pool = Pool(n=2, devices="cpu", show_topology=False)
pool.start()
try:
    # Room for 256 MiB more than the whole pool uses now; rank 1 asks for 1 GiB.
    usage = cgroup / "memory.usage_in_bytes"
    used = int(usage.read_text()) if usage.exists() else int((cgroup / "memory.current").read_text())
    limit = str(used + 256 * 2**20)
    (cgroup / ("memory.limit_in_bytes" if usage.exists() else "memory.max")).write_text(limit)
    try:
        pool.run("if rank == 1:\\n    hog = torch.ones(2**28)\\n", stream=False)
    except RankDied as error:
        print("DIED", error.exit_codes, error.summary, flush=True)
finally:
    pool.stop()
"""


@contextlib.contextmanager
def memory_cgroup() -> Iterator[Path]:
    """A fresh memory cgroup under this process's own; removed at the end."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    parents = []
    for controllers, path in (line.split(":", 2)[1:] for line in lines):
        if "memory" in controllers.split(","):
            parents.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
        elif controllers == "":
            parents.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
    made = None
    for parent in parents:
        child = parent / f"fsdpi-oom-test-{os.getpid()}"
        try:
            child.mkdir()
        except OSError:
            continue
        if (child / "memory.limit_in_bytes").exists() or (child / "memory.max").exists():
            made = child
            break
        child.rmdir()
    if made is None:
        if os.environ.get("FSDPI_REQUIRE_OOM") == "1":
            pytest.fail("no writable memory cgroup here (FSDPI_REQUIRE_OOM=1)")
        pytest.skip("no writable memory cgroup here (FSDPI_REQUIRE_OOM=1 makes this a failure)")
    try:
        yield made
    finally:
        deadline = time.monotonic() + 30
        while True:
            try:
                made.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def test_a_rank_the_oom_killer_ends_is_reported_as_out_of_memory():
    with memory_cgroup() as cgroup:
        out, err = run_script_streams(_OOM_SCRIPT, str(cgroup), timeout=300)
    died = [line for line in out.splitlines() if line.startswith("DIED")]
    assert died, f"rank 1 was not killed:\n{out}\n{err[-3000:]}"
    [line] = died
    assert "rank 1 (pid " in line and "died: killed by signal SIGKILL (out of memory: " in line
    assert (
        "the kernel's OOM killer ended it (kernel log: " in line or "of its memory cgroup" in line
    )


def test_a_risen_cgroup_counter_alone_names_the_oom_killer(tmp_path, monkeypatch):
    # This process's real cgroup, its counter file replaced by one the test writes.
    counter = _oom.counter_file(os.getpid())
    if counter is None:
        pytest.skip("this process has no readable memory cgroup counter")
    root = tmp_path / "cgroup"
    relative = Path(counter).relative_to("/sys/fs/cgroup")
    fake = root / relative
    fake.parent.mkdir(parents=True)
    fake.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    monkeypatch.setattr(_oom, "_CGROUP_ROOT", str(root))
    monkeypatch.setattr(_oom, "kernel_log_kill", lambda pid: None)
    assert _oom.counter_file(os.getpid(), str(root)) == str(fake)
    monkeypatch.setattr(_oom, "counter_file", lambda pid: str(fake))
    records = _oom.OomRecords({1: os.getpid()})
    fake.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    sigkill = -signal.SIGKILL
    assert records.explain({1: sigkill, 2: sigkill}) == {
        1: "out of memory: the kernel's OOM killer ended a process of its memory cgroup "
        f"meanwhile ({fake}: oom_kill 4 -> 5)"
    }
    assert records.explain({1: sigkill}) == {}  # the baseline moved on: no new OOM kill
    fake.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 6\n")
    assert records.explain({1: -signal.SIGTERM}) == {}  # only a SIGKILL is asked about


def test_the_kernel_logs_line_for_the_pid_names_the_oom_killer(tmp_path):
    # /dev/kmsg's records, one per read: "priority,sequence,microseconds since boot,flags;text"
    uptime_us = int(float(Path("/proc/uptime").read_text().split()[0]) * 1e6)
    log = tmp_path / "kmsg"
    log.write_text(
        f"6,1,{uptime_us - 10**6},-;Memory cgroup out of memory: Killed process 4242 (python) "
        "total-vm:100kB\n"
    )
    assert _oom.kernel_log_kill(4242, str(log)) == (
        "Memory cgroup out of memory: Killed process 4242 (python)"
    )
    assert _oom.kernel_log_kill(424, str(log)) is None
    assert _oom.kernel_log_kill(4242, str(log), recent_s=0.5) is None  # too old
