"""The orphan reaper: ends a pool's processes when the process that owns the pool dies.

A pool stops its engines and controller on ``stop()`` and at normal interpreter exit.
When the owner (the notebook kernel) is killed instead (SIGKILL, SIGTERM, a crash), none
of that runs, and the engines, which live in their own session, would go on. The pool
therefore starts this small watchdog, in a session of its own, next to each cluster it
owns::

    python -m fsdp_interactive.pool._reaper OWNER_PID OWNER_CREATE_TIME PIDS_FILE

It polls once a second. While the owner lives it does nothing; when ``PIDS_FILE``
disappears (the pool was stopped normally) it exits. When the owner is gone it ends
every process listed in ``PIDS_FILE`` (a JSON object ``{"pid": create_time}``, rewritten
atomically by the pool as it starts processes): SIGTERM, then SIGKILL after a grace
period, and only where pid *and* start time still match, so a reused pid is never hit.
It never looks processes up by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

_POLL_S = 1.0
_GRACE_S = 5.0


def write_pid_file(path: str | os.PathLike, pids: Mapping[int, float]) -> None:
    """Atomically replace ``path`` with ``pids`` (pid -> process start time)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({str(pid): created for pid, created in pids.items()}))
    os.replace(partial, path)


def start_reaper(pid_file: str | os.PathLike) -> subprocess.Popen:
    """Start the watchdog for the calling process and the processes in ``pid_file``."""
    owner = psutil.Process()
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsdp_interactive.pool._reaper",
            str(owner.pid),
            repr(owner.create_time()),
            str(pid_file),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a notebook interrupt of the owner's group must not reach it
    )


def _alive(pid: int, created: float) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    return None


def end_processes(pids: Mapping[int, float], grace: float = _GRACE_S) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` seconds, each live process of ``pids``.

    Returns the pids that were found alive (and so were ended).
    """
    procs = [proc for pid, created in pids.items() if (proc := _alive(pid, created))]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, still_alive = psutil.wait_procs(procs, timeout=grace)
    for proc in still_alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(still_alive, timeout=grace)
    return [proc.pid for proc in procs]


def _read_pid_file(path: Path) -> dict[int, float]:
    with contextlib.suppress(OSError, ValueError):
        return {int(pid): float(created) for pid, created in json.loads(path.read_text()).items()}
    return {}


def watch(owner_pid: int, owner_created: float, pid_file: Path) -> int:
    """Wait for the owner to die (then reap) or for ``pid_file`` to vanish (then exit)."""
    while _alive(owner_pid, owner_created) is not None:
        if not pid_file.exists():
            return 0
        time.sleep(_POLL_S)
    end_processes(_read_pid_file(pid_file))
    with contextlib.suppress(OSError):
        pid_file.unlink()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        print(
            "usage: python -m fsdp_interactive.pool._reaper OWNER_PID OWNER_CREATE_TIME PIDS_FILE",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return watch(int(args[0]), float(args[1]), Path(args[2]))


if __name__ == "__main__":
    sys.exit(main())
