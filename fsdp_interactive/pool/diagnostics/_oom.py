"""Whether a rank killed by ``SIGKILL`` was ended by the kernel's OOM killer.

Kernel side. ``SIGKILL`` looks the same whoever sent it: a person, a job scheduler, or
the Linux kernel out of memory. Two records tell the last one apart, both on the rank's
host, so only ranks on the kernel's host are asked about (a rank elsewhere is reported
as killed, nothing more):

* the kernel log (``/dev/kmsg``, where it may be read): the OOM killer writes ``Killed
  process PID`` / ``oom-kill: ... pid=PID`` for the process it ends. Lines of the last
  minutes are read, naming the rank's pid as the kernel numbers it (its outermost
  ``NSpid``, read while the rank lived);
* the rank's memory cgroup: its OOM-kill counter (cgroup v2 ``memory.events``, v1
  ``memory.oom_control``: ``oom_kill N``), read when the group formed and again at the
  death. A count that rose says the OOM killer ended a process of that cgroup meanwhile:
  the rank, unless another process of the same cgroup died the same way.

:class:`OomRecords` is made when a group forms (:class:`pool._live_group.LiveGroup`) and
asked by the death report (:meth:`pool.diagnostics._diagnosis.Diagnosis.death_error`). It
reads files only; what it cannot read (no cgroup file, a kernel log closed to this user)
simply adds nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

_CGROUP_ROOT = "/sys/fs/cgroup"
_KMSG = "/dev/kmsg"
#: Kernel-log lines older than this (seconds) are not about a death just seen.
_RECENT_S = 300.0
_OOM_KILL = re.compile(r"^oom_kill (\d+)$", re.M)


@dataclass(frozen=True)
class _Watched:
    """One local rank: its pid as the kernel log numbers it, and its cgroup's counter file."""

    kernel_pid: int
    counter: str | None


def counter_file(pid: int, root: str = _CGROUP_ROOT) -> str | None:
    """The file holding the OOM-kill counter of ``pid``'s memory cgroup (``None``: none
    that can be read)."""
    try:
        with open(f"/proc/{pid}/cgroup") as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    candidates = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if "memory" in controllers.split(","):  # cgroup v1
            candidates.append(os.path.join(root, "memory", path.lstrip("/"), "memory.oom_control"))
        elif controllers == "":  # cgroup v2
            candidates.append(os.path.join(root, path.lstrip("/"), "memory.events"))
    return next((path for path in candidates if os.access(path, os.R_OK)), None)


def oom_kills(path: str | None) -> int | None:
    """The ``oom_kill`` count of a counter file (``None``: unreadable)."""
    if path is None:
        return None
    try:
        with open(path) as file:
            found = _OOM_KILL.search(file.read())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def kernel_pid(pid: int) -> int:
    """``pid`` as the kernel (and its log) numbers it: the first of ``NSpid``."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[1])
    return pid


def kernel_log_kill(pid: int, path: str = _KMSG, recent_s: float = _RECENT_S) -> str | None:
    """The OOM killer's kernel-log line about ``pid`` from the last ``recent_s`` seconds,
    up to the process's name (``None``: none, or the log cannot be read here)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with open("/proc/uptime") as uptime:
            now_us = float(uptime.read().split()[0]) * 1e6
    except (OSError, ValueError):
        now_us = None
    killed = re.compile(rf"^.*?Killed process {pid} \([^)]*\)|^oom-kill:.*\bpid={pid}\b")
    found = None
    try:
        while True:
            try:
                record = os.read(descriptor, 8192).decode(errors="replace")
            except BlockingIOError:
                break  # the end of the log
            except OSError:
                continue  # a record overwritten while reading: the next one
            if not record:
                break  # a plain file's end
            prefix, _, message = record.partition(";")
            fields = prefix.split(",")
            match = killed.search(message) if len(fields) >= 3 else None
            if match is None:
                continue
            with contextlib.suppress(ValueError):
                if now_us is not None and now_us - int(fields[2]) > recent_s * 1e6:
                    continue
            if found is None or "Killed process" in match.group(0):
                found = match.group(0)  # "... Killed process PID (name)" preferred
    finally:
        os.close(descriptor)
    return found


class OomRecords:
    """The OOM records of a group's ranks on this host (``pids``: rank -> pid of the
    ranks whose processes run here), read from the group's start on."""

    def __init__(self, pids: Mapping[int, int]) -> None:
        began = time.monotonic()
        self._ranks = {
            rank: _Watched(kernel_pid(pid), counter_file(pid)) for rank, pid in pids.items()
        }
        self._counts = {w.counter: oom_kills(w.counter) for w in self._ranks.values() if w.counter}
        log.debug(
            "OOM records of ranks %s: %s (read in %.3fs)",
            sorted(self._ranks),
            self._counts,
            time.monotonic() - began,
        )

    def explain(self, exit_codes: Mapping[int, int | None]) -> dict[int, str]:
        """Why each rank of ``exit_codes`` (rank -> exit status) was killed, for those the
        records say the OOM killer ended (only a ``SIGKILL`` is asked about). The cgroup
        counters are read once for all of them, and are the baseline of the next call."""
        counts = {counter: oom_kills(counter) for counter in self._counts}
        causes = {}
        for rank, code in exit_codes.items():
            watched = self._ranks.get(rank)
            if watched is None or code != -signal.SIGKILL:
                continue
            line = kernel_log_kill(watched.kernel_pid)
            if line is not None:
                causes[rank] = (
                    f"out of memory: the kernel's OOM killer ended it (kernel log: {line})"
                )
                continue
            before = self._counts.get(watched.counter) if watched.counter else None
            now = counts.get(watched.counter) if watched.counter else None
            if before is None or now is None or now <= before:
                continue
            kills = now - before
            causes[rank] = (
                "out of memory: the kernel's OOM killer ended "
                + ("a process" if kills == 1 else f"{kills} processes")
                + f" of its memory cgroup meanwhile ({watched.counter}: oom_kill {before} -> {now})"
            )
        self._counts.update(counts)
        return causes
