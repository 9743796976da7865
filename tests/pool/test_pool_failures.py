"""Hangs, interrupts and dying ranks on the shared 2-rank pool; the pool restarts after each."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdp_interactive.pool import (
    Pool,
    PoolBusy,
    PoolNotRunning,
    RankDied,
    RankInterrupted,
    RankTimeout,
    RunResult,
)
from fsdp_interactive.pool._dispatch import PendingCall
from fsdp_interactive.pool.processes._pids import start_time
from tests.pool.conftest import record, wait_gone

pytestmark = pytest.mark.timing


def _when_files_exist(paths: list[Path], action: Callable[[], None], timeout: float = 60) -> None:
    """Run ``action`` in a thread as soon as every path exists (ranks create them)."""

    def watch() -> None:
        end = time.monotonic() + timeout
        while not all(p.exists() for p in paths):
            if time.monotonic() > end:
                return
            time.sleep(0.02)
        action()

    threading.Thread(target=watch, daemon=True).start()


def _interrupt_this_process() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def _ctrl_c_once_waiting(timeout: float = 120) -> threading.Thread:
    """Press Ctrl-C on this process once its main thread waits for a call (inside
    ``PendingCall.wait``), as a user does; a thread, to be joined."""
    main, waiting = threading.main_thread().ident, PendingCall.wait.__code__

    def in_wait() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code is not waiting:
            frame = frame.f_back
        return frame is not None

    def watch() -> None:
        end = time.monotonic() + timeout
        while not in_wait():
            if time.monotonic() > end:
                return  # the test's own wait then fails, naming what it waited for
            time.sleep(0.01)
        _interrupt_this_process()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _assert_ctrl_c_raises_here() -> None:
    """The tests below press Ctrl-C on this process; if something earlier in the session
    replaced Python's SIGINT handler, say so now instead of waiting for a KeyboardInterrupt
    that never comes."""
    handler = signal.getsignal(signal.SIGINT)
    assert handler is signal.default_int_handler, f"SIGINT handler of the test process: {handler!r}"


def _arrive(marker_dir: Path) -> str:
    return f"import os\nopen(os.path.join({str(marker_dir)!r}, f'arrived{{rank}}'), 'w').close()\n"


def _restart_and_check(pool: Pool) -> None:
    old = {r.pid for r in pool.topology}
    pool.restart()
    record(pool)
    assert pool.running and not pool.needs_restart
    assert {r.pid for r in pool.topology}.isdisjoint(old)
    assert pool.run("dist.all_reduce(t := torch.ones(1)); t.item()", stream=False).results == {
        0: "2.0",
        1: "2.0",
    }


def test_slow_run_times_out_with_stacks_and_can_be_waited_for(pool: Pool, marker_dir: Path):
    # Rank 1 is slow until the test lets it go (after the timeout's report).
    go = marker_dir / "go"
    code = (
        f"import os, time\nif rank == 1:\n    while not os.path.exists({str(go)!r}):\n"
        "        time.sleep(0.05)\ndist.barrier()\nrank"
    )
    try:
        with pytest.raises(RankTimeout) as info:
            pool.run(code, timeout=1.5, stream=False)
    finally:
        go.touch()
    err = info.value
    assert isinstance(err, TimeoutError)
    assert err.pending == [0, 1]
    assert "barrier" in err.where[0], err.where
    assert "time.sleep(0.05)" in err.where[1], err.where
    result = err.wait(60)  # the ranks were not stopped: the same run completes
    assert isinstance(result, RunResult) and result.results == {0: "0", 1: "1"}


def test_mismatched_collective_times_out_then_interrupt_says_restart(pool: Pool, capsys):
    code = (
        "import time\n"
        "if rank == 0:\n"
        "    dist.barrier()\n"
        "else:\n"
        "    while True:\n"
        "        time.sleep(0.1)\n"
    )
    with pytest.raises(RankTimeout) as info:
        pool.run(code, timeout=2)
    err = info.value
    assert sorted(err.stacks) == [0, 1]
    assert err.where[0].startswith("in barrier (distributed_c10d.py:")
    assert err.where[0].endswith("called from <cell>:3: dist.barrier()")
    assert "time.sleep(0.1)" in err.where[1]
    assert "distributed_c10d.py" in err.stacks[0] and "in barrier" in err.stacks[0]
    assert "    dist.barrier()" in err.stacks[0]  # the cell frame with its source line
    assert "in barrier" not in err.stacks[1]
    text = str(err)
    assert "rank 0: in barrier" in text and "rank 1: in <module>" in text
    # The flight recorder: rank 0 issued one more collective than rank 1.
    [finding] = err.diagnosis
    seq = finding.split("#")[1].split(";")[0]
    assert finding.startswith(f"rank 0 waits in barrier #{seq}; rank 1 never issued #{seq}")
    assert f"collectives: {finding}" in text
    assert pool.busy_ranks() == [0, 1]
    with pytest.raises(PoolBusy, match="still run an earlier call"):
        pool.run("1")

    # Keep waiting, then "press Ctrl-C": SIGINT goes to both ranks; rank 1 stops,
    # rank 0 stays blocked inside the collective and the pool says to restart.
    _assert_ctrl_c_raises_here()
    pressed = _ctrl_c_once_waiting()
    with pytest.raises(RankInterrupted) as interrupted:
        err.wait()
    pressed.join()
    stopped = interrupted.value
    assert stopped.ranks == [0, 1]
    assert list(stopped.stuck) == [0] and "barrier" in stopped.stuck[0]
    assert stopped.needs_restart and pool.needs_restart
    assert "must be restarted" in str(stopped)
    assert pool.busy_ranks() == [0]
    _restart_and_check(pool)


def test_ctrl_c_interrupts_a_long_loop_and_the_pool_stays_usable(pool: Pool, marker_dir: Path):
    # The marker is written inside the loop: once it exists, ``step`` does too.
    code = (
        "import time\nfor step in range(100000):\n    if step == 0:\n"
        + "".join(f"        {line}\n" for line in _arrive(marker_dir).splitlines())
        + "    time.sleep(0.05)\n"
    )
    paths = [marker_dir / f"arrived{r}" for r in (0, 1)]
    _assert_ctrl_c_raises_here()
    _when_files_exist(paths, _interrupt_this_process)
    started = time.monotonic()
    with pytest.raises(RankInterrupted) as info:
        pool.run(code, timeout=120, stream=False)
    assert time.monotonic() - started < 60
    assert info.value.ranks == [0, 1]
    assert info.value.stuck == {} and not info.value.needs_restart
    assert pool.pull("step")[0] < 99999
    assert pool.run("rank", stream=False).results == {0: "0", 1: "1"}


def test_interrupt_method_stops_a_running_loop(pool: Pool, marker_dir: Path):
    code = _arrive(marker_dir) + "import time\nwhile True:\n    time.sleep(0.05)\n"
    paths = [marker_dir / f"arrived{r}" for r in (0, 1)]
    _when_files_exist(paths, pool.interrupt)
    with pytest.raises(RankInterrupted) as info:
        pool.run(code, timeout=120, stream=False)
    assert info.value.ranks == [0, 1] and not info.value.needs_restart
    assert pool.run("rank", stream=False).results == {0: "0", 1: "1"}


def test_sigkill_during_all_reduce_loop_raises_rank_died(pool: Pool, marker_dir: Path, capsys):
    victim = pool.topology[1].pid
    survivor = {pool.topology[0].pid: 0.0}

    survivor = {pid: start_time(pid) for pid in survivor}
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    code = (
        _arrive(marker_dir)
        + "t = torch.ones(64)\nfor step in range(10**9):\n    dist.all_reduce(t)\n    t.fill_(1)\n"
    )
    _when_files_exist([marker_dir / f"arrived{r}" for r in (0, 1)], kill)
    with pytest.raises(RankDied) as info:
        pool.run(code, timeout=120, stream=False)
    latency = time.monotonic() - killed_at[0]
    err = info.value
    assert err.ranks == [1]
    assert err.exit_codes[1] == -signal.SIGKILL
    assert "killed by signal SIGKILL" in str(err) and "pool.restart()" in str(err)
    assert pool.state == "broken"
    assert wait_gone(survivor) == [], "the surviving rank must not be left hanging"
    with pytest.raises(PoolNotRunning, match="restart"):
        pool.run("1")
    with capsys.disabled():
        print(f"\n[measured] SIGKILL -> RankDied latency: {latency:.2f}s")
    _restart_and_check(pool)
