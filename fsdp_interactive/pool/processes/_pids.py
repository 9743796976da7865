"""Processes named by pid *and* start time, so that a reused pid is never mistaken for them.

A pid alone does not name a process for long: once a process has ended the kernel may
give its pid to an unrelated one. Every place that asks whether a process the pool
started still runs, or that ends one, therefore goes through these functions with the
start time (:func:`process_start`) recorded when the process was seen.

The start time counts from the host's boot, not from the epoch: psutil's
``create_time()`` adds a boot time it derives from the wall clock, so a step of the clock
(NTP on a virtual machine steps it by seconds) moves every process's ``create_time()``,
and each process the pool recorded would look replaced by another: never ended, an
orphan. Seconds since boot stay fixed for a process's life.

Kept free of everything but psutil: the orphan reaper (:mod:`._reaper`) imports it in a
process of its own that must start fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

import psutil

log = logging.getLogger(__name__)

GRACE_S = 5.0


_PROC = "/proc"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_start(proc: psutil.Process) -> float:
    """Seconds from the host's boot to ``proc``'s start, fixed for the process's life
    (``starttime`` of ``/proc/PID/stat``); where there is no ``/proc``, psutil's
    ``create_time()``. Raises ``psutil.NoSuchProcess`` when the process is gone."""
    if not os.path.isdir(_PROC):
        return proc.create_time()
    try:
        with open(f"{_PROC}/{proc.pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise psutil.NoSuchProcess(proc.pid) from exc
    # After the command's closing parenthesis the fields start at the third, the state;
    # starttime is the 22nd (proc(5)).
    return int(fields[22 - 3]) / _CLOCK_TICKS


def start_time(pid: int) -> float | None:
    """The start time (:func:`process_start`) of the process that has ``pid`` now
    (``None``: there is none)."""
    with contextlib.suppress(psutil.Error):
        return process_start(psutil.Process(pid))
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
        if process_start(proc) == created and proc.status() != psutil.STATUS_ZOMBIE:
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
