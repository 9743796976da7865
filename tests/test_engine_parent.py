"""The parent remote engines run under: it reports how the engine ended and ends the same way."""

from __future__ import annotations

import signal
import subprocess
import sys

from fsdp_interactive.pool._engine_parent import parse_exit, wrap

PARENT = [sys.executable, "-m", "fsdp_interactive.pool._engine_parent", "--"]


def test_an_engine_killed_by_a_signal_is_reported_and_its_parent_ends_the_same_way():
    child = (
        "import os, signal; print('engine up', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run(
        [*PARENT, sys.executable, "-c", child], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == -signal.SIGKILL
    assert out.stdout == "engine up\n"
    assert parse_exit(out.stderr) == -signal.SIGKILL, out.stderr


def test_signals_to_the_parent_reach_the_engine():
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [*PARENT, sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 7
    assert parse_exit(err) == 7, err


def test_exit_reports_are_told_apart_by_pid_and_host():
    text = (
        "fsdp-interactive engine ended: pid 11 on hosta exit -9\n"
        "noise\n"
        "fsdp-interactive engine ended: pid 12 on hostb exit 3\n"
    )
    assert parse_exit(text, pid=11) == -9
    assert parse_exit(text, pid=12, host="hostb") == 3
    assert parse_exit(text, pid=12, host="hosta") is None
    assert parse_exit("nothing here") is None


def test_only_engine_commands_are_wrapped():
    assert wrap(["/py", "-m", "ipyparallel.engine", "--mpi"]) == [
        "/py", "-m", "fsdp_interactive.pool._engine_parent", "--",
        "/py", "-m", "ipyparallel.engine", "--mpi",
    ]  # fmt: skip
    assert wrap(["my-engine", "--x"]) == ["my-engine", "--x"]
