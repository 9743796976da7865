"""Processes named by pid *and* start time, so that a reused pid is never mistaken for them.

A pid alone does not name a process for long: once a process has ended the kernel may
give its pid to an unrelated one. Every place that asks whether a process the pool
started still runs, or that ends one, therefore goes through these functions with the
start time (``psutil.Process.create_time()``) recorded when the process was seen.

Kept free of everything but psutil: the orphan reaper (:mod:`._reaper`) imports it in a
process of its own that must start fast.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

import psutil

log = logging.getLogger(__name__)

GRACE_S = 5.0


def start_time(pid: int) -> float | None:
    """The start time of the process that has ``pid`` now (``None``: there is none)."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).create_time()
    return None


def running_process(pid: int, created: float | None) -> psutil.Process | None:
    """The live process ``(pid, created)``, or ``None`` when it has ended.

    A zombie has ended. A process with that pid but another start time is another
    process: ``None``. ``created=None`` (the start time was never seen, because the
    process was gone before it was recorded) also gives ``None``.
    """
    if created is None:
        return None
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    return None


def is_running(pid: int, created: float | None) -> bool:
    """Whether the process ``(pid, created)`` still runs (see :func:`running_process`)."""
    return running_process(pid, created) is not None


def still_running(pids: Mapping[int, float]) -> list[int]:
    """Those of ``pids`` (pid -> start time) that still run."""
    return [pid for pid, created in pids.items() if is_running(pid, created)]


def end_processes(pids: Mapping[int, float], grace: float = GRACE_S) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` seconds, each live process of ``pids``.

    ``pids`` maps pid -> start time; only processes whose start time still matches are
    signalled. Returns the pids that were found alive (and so were ended).
    """
    procs = [proc for pid, created in pids.items() if (proc := running_process(pid, created))]
    for proc in procs:
        log.debug("pid %d still runs: SIGTERM", proc.pid)
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, survivors = psutil.wait_procs(procs, timeout=grace)
    for proc in survivors:
        log.debug("pid %d survived SIGTERM for %gs: SIGKILL", proc.pid, grace)
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(survivors, timeout=grace)
    return [proc.pid for proc in procs]
