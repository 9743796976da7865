"""The parent remote engines run under: it reports how the engine ended and ends the same way."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from fsdp_interactive._engine_parent import parse_exit, wrap

PARENT = [sys.executable, "-m", "fsdp_interactive._engine_parent", "--"]


@contextlib.contextmanager
def _parent_of(child: str) -> Iterator[subprocess.Popen[str]]:
    """The parent running ``python -c child``, its stdout and stderr piped; killed (with
    its engine, which dies with it) should the test end before it does."""
    proc = subprocess.Popen(
        [*PARENT, sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
    with _parent_of(child) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
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
        "/py", "-m", "fsdp_interactive._engine_parent", "--",
        "/py", "-m", "ipyparallel.engine", "--mpi",
    ]  # fmt: skip
    assert wrap(["my-engine", "--x"]) == ["my-engine", "--x"]


def _blocks(pid: int, sig: signal.Signals) -> bool:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigBlk:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_signal_that_comes_while_the_engine_starts_is_passed_on():
    with _parent_of("import time; time.sleep(60)") as proc:
        # The parent holds the signals from just before it starts the engine; one sent now
        # may find the engine not yet running, and must reach it all the same.
        deadline = time.monotonic() + 30
        while not _blocks(proc.pid, signal.SIGTERM):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert parse_exit(err) == -signal.SIGTERM, err
    assert proc.returncode == -signal.SIGTERM


def test_the_parent_loads_only_the_packages_own_standard_library_modules():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *PARENT[1:], sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    # The package's __init__ and its lazy-export helper (standard library only): torch,
    # ipyparallel and every subpackage stay unloaded.
    assert {name for name in loaded if name.startswith("fsdp_interactive")} == {
        "fsdp_interactive",
        "fsdp_interactive._lazy_exports",
    }, sorted(loaded)
    assert not {"torch", "ipyparallel", "IPython", "zmq"} & loaded, sorted(loaded)
