"""A process is named by pid and start time: a reused pid is another process, an ended one is dead."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import psutil
import pytest

from fsdp_interactive.pool import Pool
from fsdp_interactive.pool._dispatch import dead_ranks
from fsdp_interactive.pool.processes._pids import (
    end_processes,
    is_running,
    start_time,
    still_running,
)

pytestmark = pytest.mark.timing


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_live_pid_with_another_start_time_is_not_the_recorded_process():
    me = os.getpid()
    created = start_time(me)
    assert start_time(me) == created
    assert is_running(me, created)
    # What a reused pid looks like: the pid runs, but it is not the process recorded.
    assert not is_running(me, created - 1.0)
    assert not is_running(me, None)  # never seen alive
    assert still_running({me: created - 1.0}) == []


def test_a_step_of_the_wall_clock_neither_hides_a_process_nor_spares_it(monkeypatch):
    """NTP steps a virtual machine's clock by seconds: psutil's ``create_time()`` (boot time
    from the wall clock, plus the start in ticks) moves with it. A recorded process must
    still run and still be ended, or a stop would leave it an orphan."""
    import psutil._pslinux as psutil_linux  # where psutil derives the boot time on Linux

    child = _sleeper()
    try:
        created = start_time(child.pid)
        seen_before = psutil.Process(child.pid).create_time()
        booted = psutil_linux.boot_time
        monkeypatch.setattr(psutil_linux, "boot_time", lambda: booted() + 30.0)
        # The step as psutil sees it: the same process, 30 s "later".
        assert psutil.Process(child.pid).create_time() == pytest.approx(seen_before + 30.0)
        assert start_time(child.pid) == created
        assert is_running(child.pid, created)
        assert end_processes({child.pid: created}, grace=1.0) == [child.pid]
        assert child.wait(timeout=10) is not None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_recorded_process_that_ended_is_dead():
    child = _sleeper()
    recorded = {child.pid: start_time(child.pid)}
    assert still_running(recorded) == [child.pid]
    child.kill()
    child.wait(timeout=30)
    assert still_running(recorded) == []


def test_a_zombie_counts_as_ended():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    created = start_time(child.pid)
    try:
        psutil.wait_procs([psutil.Process(child.pid)], timeout=30)  # exits; not reaped yet
        assert not is_running(child.pid, created)
    finally:
        child.wait(timeout=30)


def test_end_processes_spares_a_pid_whose_start_time_differs():
    child = _sleeper()
    try:
        created = start_time(child.pid)
        assert created is not None
        assert end_processes({child.pid: created - 1.0}, grace=1) == []
        assert child.poll() is None, "a process that is not the recorded one was signalled"
        assert end_processes({child.pid: created}, grace=5) == [child.pid]
        assert not is_running(child.pid, created)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def test_a_rank_whose_recorded_start_time_differs_is_reported_dead(pool: Pool):
    """The pool's death check asks for (pid, start time): a live engine process with
    another start time (its pid reused) is not the rank's engine."""
    records = pool.topology
    engines = {r.pid: pool._processes.engine(r.pid) for r in records}
    assert all(engine is not None and engine.alive() for engine in engines.values())
    assert dead_ranks(pool._client, records, engines.get) == []

    victim = records[1].pid
    reused = dataclasses.replace(engines[victim], created=engines[victim].created - 1.0)
    assert not reused.alive()
    forged = {**engines, victim: reused}
    assert dead_ranks(pool._client, records, forged.get) == [1]
    assert pool.running  # nothing was torn down: only the check was asked
