"""What a rank wrote during the call it died in: its output and its engine log since the
call began, nothing older.

Notebook side, plain text in and out. Two sources, each from the rank or its host's
launcher, for local and remote ranks alike:

* its output: the stdout and stderr the kernel received from the rank during the call
  (:class:`CallRecord`); what the rank printed in the last moment before it was killed
  may not have reached the kernel;
* its engine log (what the rank's launcher keeps: a local log file, or the output a
  remote launcher copies back) from the line on which the engine took the call's
  request: ipyparallel's engine logs ``Handling <type>_request: <request id>`` as it
  takes each request (checked on ipyparallel 9.0 and 9.2.0). There the rank's lower
  layers write what the kernel never receives: a crash report ("Fatal Python error",
  faulthandler's stacks), writes to file descriptor 2 of C/C++ code. ipyparallel's own
  log records there (its engine's and its nanny's: requests taken, the nanny seeing its
  engine end) and the pool's exit line for the engine are left out (the exit status is
  reported anyway).

Older lines (a traceback of an earlier cell, earlier requests) are never shown. A log
without the request's line (the engine never took the call, or what the launcher kept
of the log is too short: an ssh host's forker sends its last 64 KiB) is shown only for a
crash report in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fsdp_interactive._engine_parent import MARKER as EXIT_MARKER
from fsdp_interactive._lines import final_text

_TAKEN = re.compile(r"\bHandling (\w+_request): (\S+)\s*$")
#: A record of ipyparallel's loggers (engine, nanny): "2026-01-05 08:06:06.311 [IPEngine.0] ..."
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \[[^\]\s]+\] ")
_FATAL = "Fatal Python error"
_MAX_LINES = 20


@dataclass(frozen=True)
class CallRecord:
    """One rank's part of the call it was running: ``request``, the ipyparallel request
    id of its share of the call; ``output``, its stdout and stderr as the kernel
    received them during the call (each line in its final state)."""

    request: str
    output: str = ""


def request_taken_at(log: str, request: str) -> int | None:
    """The index, in ``log.splitlines()``, of the line on which the engine took
    ``request`` (``None``: the log has no such line)."""
    for index, line in enumerate(log.splitlines()):
        match = _TAKEN.search(line)
        if match is not None and match.group(2) == request:
            return index
    return None


def _written_by_rank(lines: list[str]) -> list[str]:
    return [line for line in lines if not _LOG_RECORD.match(line) and EXIT_MARKER not in line]


def _crash_report(lines: list[str], limit: int) -> list[str]:
    fatal = [i for i, line in enumerate(lines) if line.startswith(_FATAL)]
    return lines[fatal[-1] : fatal[-1] + 3 * limit] if fatal else []


@dataclass(frozen=True)
class LogDuring:
    """What an engine log holds of one call: ``began``, whether the engine took the
    call's request (``None``: the log is empty or could not be read, so it cannot tell);
    ``text``, the lines written since (see :func:`log_during`)."""

    began: bool | None
    text: str


def log_during(log: str, request: str | None, limit: int = _MAX_LINES) -> LogDuring:
    """The lines of an engine ``log`` written since the engine took ``request`` (the
    last ``limit``; a crash report is kept from its first line, up to ``3 * limit``).

    Without the request's line (or without a request) only a crash report in the log
    is kept.
    """
    if not log.strip():
        return LogDuring(None, "")
    lines = log.splitlines()
    taken = request_taken_at(log, request) if request is not None else None
    if taken is None:
        return LogDuring(False, "\n".join(_crash_report(lines, limit)))
    during = _written_by_rank(lines[taken + 1 :])
    crash = _crash_report(during, limit)
    return LogDuring(True, "\n".join(crash or during[-limit:]))


def last_lines(text: str, limit: int = _MAX_LINES) -> str:
    """The last ``limit`` lines of a rank's output, each in its final state."""
    lines = final_text(text).rstrip("\n").splitlines()
    return "\n".join(lines[-limit:])


def death_report(rank: int, record: CallRecord | None, log: LogDuring) -> str:
    """The text that tells what rank ``rank`` wrote during the call it died in.

    ``record``: its part of the call (``None``: it was not part of it); ``log``: what
    :func:`log_during` kept of its engine log.
    """
    logged = log.text.rstrip()
    if record is None:
        if logged:
            return f"--- rank {rank} was not part of this call; its engine log shows a crash ---\n{logged}"
        return f"--- rank {rank} was not part of this call ---"
    parts = []
    output = last_lines(record.output)
    if output.strip():
        parts.append(f"--- what rank {rank} printed during this call ---\n{output}")
    if logged and log.began:
        parts.append(f"--- rank {rank}'s engine log during this call ---\n{logged}")
    elif logged:
        parts.append(f"--- rank {rank}'s engine log shows a crash ---\n{logged}")
    if parts:
        return "\n".join(parts)
    if log.began is False:  # it died before taking the call, or the log kept is too short
        return (
            f"--- rank {rank} wrote nothing during this call: its engine log has no line "
            "from it ---"
        )
    return f"--- rank {rank} wrote nothing during this call ---"


def idle_death_report(rank: int, log: LogDuring) -> str:
    """What to show of rank ``rank`` that died while no call ran on it: a crash report its
    engine log holds (:func:`log_during` without a request keeps only that), else that it
    ran nothing."""
    logged = log.text.rstrip()
    if logged:
        return f"--- rank {rank} ran no call; its engine log shows a crash ---\n{logged}"
    return f"--- rank {rank} ran no call when it died ---"
