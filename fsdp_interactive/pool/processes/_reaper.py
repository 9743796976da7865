"""The orphan reaper: ends a pool's processes when the process that owns the pool dies.

A pool stops its engines and controller on ``stop()`` and at normal interpreter exit.
When the owner (the notebook kernel) is killed instead (SIGKILL, SIGTERM, a crash), none
of that runs, and the engines, which live in their own session, would go on. The pool
therefore starts this small watchdog, in a session of its own, next to each cluster it
owns::

    python -m fsdp_interactive.pool.processes._reaper OWNER_PID OWNER_CREATE_TIME PIDS_FILE \
        [LOG_LEVEL]

with ``{"remove": [DIR, ...]}`` on its stdin (the folders to remove: private paths go on
no command line, which ``ps`` shows every user). It polls once a second. While the owner lives it does nothing; when ``PIDS_FILE``
disappears (the pool was stopped normally) it exits. When the owner is gone it ends
every process listed in ``PIDS_FILE`` (a JSON object ``{"pid": start time}``, the start
time of :func:`._pids.start_time`, rewritten atomically by the pool as it starts processes): SIGTERM, then SIGKILL after a grace
period, and only where pid *and* start time still match, so a reused pid is never hit.
It never looks processes up by name. Then it removes each folder of ``remove``: the
pool's snapshot root on this host (:mod:`fsdp_interactive.pool.common._snapshot_root`,
which the engine forker removes too unless it was killed) and its socket folder
(:mod:`fsdp_interactive.pool.common._socket_folder`); each of those refuses any other
name, and leaves a folder that is not a private folder of this user. Last it removes
``PIDS_FILE`` and its folder, if that is then empty.

With ``LOG_LEVEL`` (a :mod:`logging` level name) it logs its decisions on stderr, which
:func:`start_reaper` sends to a log file, since nobody is left to show them when it acts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from fsdp_interactive import _private_files
from fsdp_interactive.pool.common import _snapshot_root, _socket_folder
from fsdp_interactive.pool.processes._pids import end_processes, is_running, process_start

log = logging.getLogger(__name__)

_POLL_S = 1.0


def write_pid_file(path: str | os.PathLike, pids: Mapping[int, float]) -> None:
    """Atomically replace ``path`` with ``pids`` (pid -> process start time)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({str(pid): created for pid, created in pids.items()}))
    os.replace(partial, path)


def start_reaper(
    pid_file: str | os.PathLike,
    *,
    log_level: int | None = None,
    log_path: str | os.PathLike | None = None,
    remove: Sequence[str] = (),
) -> subprocess.Popen:
    """Start the watchdog for the calling process and the processes in ``pid_file``.

    With ``log_level`` and ``log_path`` its decisions are appended to ``log_path``.
    ``remove``: snapshot roots it removes once it has ended the processes.
    """
    owner = psutil.Process()
    command = [
        sys.executable,
        "-m",
        "fsdp_interactive.pool.processes._reaper",
        str(owner.pid),
        repr(process_start(owner)),
        str(pid_file),
    ]
    logs = log_level is not None and log_path is not None
    if logs:
        command.append(logging.getLevelName(log_level))
    orders = json.dumps({"remove": [str(folder) for folder in remove]}).encode()
    if logs:
        with os.fdopen(_private_files.open_log(log_path), "ab") as log_file:  # type: ignore[arg-type]
            return _spawn(command, log_file, orders)
    return _spawn(command, subprocess.DEVNULL, orders)


def _spawn(command: list[str], stderr: object, orders: bytes) -> subprocess.Popen:
    reaper = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=stderr,  # type: ignore[arg-type]
        start_new_session=True,  # a notebook interrupt of the owner's group must not reach it
    )
    assert reaper.stdin is not None
    with contextlib.suppress(OSError), reaper.stdin:
        reaper.stdin.write(orders)
    return reaper


def read_orders(stream: Any) -> list[str]:
    """The folders to remove, from the JSON object on ``stream`` (the reaper's stdin; an
    empty or unreadable one: none)."""
    with contextlib.suppress(OSError, ValueError):
        orders = json.loads(stream.read() or "{}")
        folders = orders.get("remove") if isinstance(orders, dict) else None
        if isinstance(folders, list):
            return [folder for folder in folders if isinstance(folder, str)]
    return []


def _read_pid_file(path: Path) -> dict[int, float]:
    with contextlib.suppress(OSError, ValueError):
        return {int(pid): float(created) for pid, created in json.loads(path.read_text()).items()}
    return {}


def watch(owner_pid: int, owner_created: float, pid_file: Path, remove: Sequence[str] = ()) -> int:
    """Wait for the owner to die (then reap, and remove ``remove``) or for ``pid_file`` to
    vanish (then exit)."""
    log.debug("watching owner pid %d for the processes in %s", owner_pid, pid_file)
    while is_running(owner_pid, owner_created):
        if not pid_file.exists():
            log.debug("pid file gone: the pool was stopped normally; exiting")
            return 0
        time.sleep(_POLL_S)
    pids = _read_pid_file(pid_file)
    log.info("owner pid %d is gone: ending its %d recorded processes", owner_pid, len(pids))
    ended = end_processes(pids)
    log.info("ended pids %s; the others had exited already", sorted(ended))
    for folder in remove:
        sockets = os.path.basename(os.path.normpath(folder)).startswith(_socket_folder.PREFIX)
        try:
            if sockets and _socket_folder.remove_folder(folder):
                log.info("removed the socket folder %s", folder)
            elif not sockets and _snapshot_root.remove_root(folder):
                log.info("removed the snapshot root %s", folder)
        except ValueError as exc:
            log.warning("%s; left in place", exc)
    with contextlib.suppress(OSError):
        pid_file.unlink()
    with contextlib.suppress(OSError):
        pid_file.parent.rmdir()  # the pool's folder for it, once empty
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (3, 4):
        print(
            "usage: python -m fsdp_interactive.pool.processes._reaper "
            'OWNER_PID OWNER_CREATE_TIME PIDS_FILE [LOG_LEVEL]  (stdin: {"remove": [DIR]})',
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    remove = read_orders(sys.stdin)
    if len(args) == 4:
        logging.basicConfig(
            level=args[3], format="%(asctime)s reaper %(levelname)s %(name)s: %(message)s"
        )
    return watch(int(args[0]), float(args[1]), Path(args[2]), remove)


if __name__ == "__main__":
    sys.exit(main())
