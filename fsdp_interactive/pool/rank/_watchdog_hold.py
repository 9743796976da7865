"""Rank side: keep torch's NCCL watchdog from ending a rank while a person debugs.

With NCCL, every collective is watched by ProcessGroupNCCL's watchdog thread: one that
has not completed on the GPU ``pg_timeout`` after it was issued makes the watchdog end
the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default, torch 2.9 .. 2.14). While a
person types at a breakpoint (``fsdp_interactive.breakpoint()``) or in a post-mortem
session (``%fsdp debug``), collectives issued before the stop may be waiting for the
stopped rank, on this rank or its peers; the watchdog would end them mid-session.

A *hold* stops that clock: while any hold is active, a keeper thread extends the
timeout of this rank's NCCL collectives (those in flight, and those issued until the
first one issued afterwards completes: :func:`fsdp_interactive._torch_compat.extend_nccl_timeouts`)
by the time that passes, a second at a time and a little ahead. When the last hold ends
the clock runs again from where it stood, so a collective that can never complete is
still ended ``pg_timeout`` of *unheld* time after it was issued.

Holds are named (``"breakpoint"``, ``"post-mortem"``) and either last until released or
lapse after a number of seconds (a post-mortem session the user walked away from).

Not done: holding gloo collectives (gloo has no watchdog that ends the process: a gloo
collective past its timeout raises in the rank), or the NCCL heartbeat monitor
(``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``), which watches the watchdog thread itself and is
not stopped by a paused Python thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time

log = logging.getLogger(__name__)

#: How often the keeper extends the timeouts, and how far ahead of the clock it stays.
STEP_S = 1.0
_AHEAD_S = 2 * STEP_S

_lock = threading.Lock()
_holds: dict[str, float] = {}  # name -> monotonic deadline (inf: until released)
_keeper: threading.Thread | None = None
_wake = threading.Condition(_lock)
_extended_s = 0.0


def hold(name: str, seconds: float | None = None) -> None:
    """Start (or renew) the hold ``name``: until :func:`release` (``seconds=None``) or for
    ``seconds``. ``seconds <= 0`` releases it."""
    if seconds is not None:
        seconds = float(seconds)
    global _keeper
    if seconds is not None and seconds <= 0:
        release(name)
        return
    with _lock:
        first = not _active_locked()
        _holds[name] = math.inf if seconds is None else time.monotonic() + float(seconds)
        if _keeper is None or not _keeper.is_alive():
            _keeper = threading.Thread(
                target=_keep, name="fsdp-interactive-watchdog-hold", daemon=True
            )
            _keeper.start()
        _wake.notify_all()
    if first:
        log.debug("NCCL watchdog held (%s)", name)


def release(name: str) -> None:
    """End the hold ``name`` (nothing if there is none)."""
    with _lock:
        _holds.pop(name, None)
        _wake.notify_all()


class held:
    """``with held("breakpoint"): ...``: a hold for the duration of the block."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        hold(self.name)

    def __exit__(self, *exc: object) -> None:
        release(self.name)


def active() -> list[str]:
    """The names of the holds in force now."""
    with _lock:
        return sorted(_active_names_locked())


def extended_seconds() -> float:
    """Seconds of extension this process has asked for so far (all holds together)."""
    with _lock:
        return _extended_s


def _active_names_locked() -> list[str]:
    now = time.monotonic()
    for name in [n for n, deadline in _holds.items() if deadline <= now]:
        del _holds[name]
        log.debug("NCCL watchdog hold %s lapsed", name)
    return list(_holds)


def _active_locked() -> bool:
    return bool(_active_names_locked())


def _keep() -> None:
    """Extend by the time that passes while a hold is in force (ahead by ``_AHEAD_S``)."""
    covered_until: float | None = None  # monotonic time the extensions reach so far
    while True:
        with _lock:
            if not _active_locked():
                covered_until = None
                _wake.wait(STEP_S)
                continue
        now = time.monotonic()
        target = now + _AHEAD_S
        start = now if covered_until is None else covered_until
        if target > start:
            _extend(target - start)
            covered_until = target
        with _lock:
            _wake.wait(STEP_S)


def _extend(seconds: float) -> None:
    global _extended_s
    from fsdp_interactive._torch_compat import extend_nccl_timeouts

    try:
        extend_nccl_timeouts(seconds)
    except Exception as error:  # the rank goes on; the hold just does not help it
        log.warning("could not extend the NCCL timeouts: %s", error)
        return
    with _lock:
        _extended_s += seconds
