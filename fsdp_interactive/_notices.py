"""What a rank tells the notebook without being asked, which notebook call it runs, and
whether a recovery would bind a name again.

Rank side, a leaf (standard library only): code of any layer can publish a notice (a small
dict of plain data, such as a snapshot's record) and read the id of the notebook call it
runs in, without knowing how the pool carries either. The pool's engine hooks install the
sink, which sends notices to the kernel over the rank's diagnostics channel, and set the
current call for the duration of each call.

The pool's engine hooks also install a *judge* (:func:`set_judge`) that knows how each
name of the namespace was bound (which notebook call, replayable or not), so that a
snapshot can refuse to record a variable a recovery would not bind again
(:func:`unreplayed`).

Outside a pool (a plain torchrun job, a test) there is no sink: notices are dropped and the
current call is ``None``; nobody judges names. A sink that fails drops the notice;
publishing never raises.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Notice = dict[str, Any]

_lock = threading.Lock()
_sink: Callable[[Notice], None] | None = None
_current_call: int | None = None
_replaying = False
_judge: Callable[[str, Any, Any], str | None] | None = None


def current_call() -> int | None:
    """The id of the notebook call (a ``Pool.run`` or ``%%fsdp`` cell) this rank is running,
    or ``None`` outside one. Background threads see the call that is current when they ask;
    take it in the calling thread to keep the call that started them."""
    return _current_call


def replaying() -> bool:
    """True while the current call is one a recovery replays to rebuild the names the
    notebook defined; code that must not run twice (taking a snapshot, which would replace
    the one being recovered to) checks it."""
    return _replaying


def set_current_call(call: int | None, *, replaying: bool = False) -> None:
    """Set by the pool's engine hooks when a call begins (its id; ``replaying``: a
    recovery's replay of it) and ends (``None``)."""
    global _current_call, _replaying
    _current_call = call
    _replaying = replaying


def set_sink(sink: Callable[[Notice], None] | None) -> None:
    """Install the function that carries notices to the kernel (``None``: drop them)."""
    global _sink
    with _lock:
        _sink = sink


def publish(notice: Notice) -> None:
    """Hand ``notice`` (plain data, with a ``"kind"``) to the kernel, if a pool listens."""
    if not isinstance(notice, dict) or not isinstance(notice.get("kind"), str):
        raise TypeError(f"a notice is a dict with a 'kind' string, got {notice!r}")
    with _lock:
        sink = _sink
    if sink is None:
        return
    try:
        sink(notice)
    except Exception as error:  # the kernel may be gone; the rank's work goes on
        log.debug("notice %r not delivered: %s", notice.get("kind"), error)


def set_judge(judge: Callable[[str, Any, Any], str | None] | None) -> None:
    """Install what :func:`unreplayed` asks (``None``: nobody judges)."""
    global _judge
    _judge = judge


def unreplayed(name: str, value: Any, namespace: Any) -> str | None:
    """Why a recovery would not bind ``name`` of ``namespace`` to an object like ``value``
    (what it holds now) again, in words for the user; ``None`` when it would, or when
    nobody can tell (outside a pool, or a namespace that is not the notebook's, such as a
    running script's globals)."""
    judge = _judge
    if judge is None:
        return None
    try:
        return judge(name, value, namespace)
    except Exception as error:  # a judge that fails judges nothing
        log.debug("could not judge %r: %s", name, error)
        return None
