"""Rank side: the one notebook attached to a job's rank, and what happens when it goes.

A notebook attaches by opening a *session link* to every rank (``{"op": "session",
"session": id, "client": ...}`` on an authenticated connection, kept open): from then on
the requests that change the job (pause, cells, detach) must carry that session's id.
A second notebook is refused while the link of the first is open, naming who holds it,
unless it asks to take over (``take_over``): the first is then told (``{"kind":
"taken_over", "by": ...}``) and its link closed. Status, stacks and collectives need the
key only, not a session.

The link also tells this rank that its notebook went away: the notebook sends
:data:`pool.common._agent_wire.GOODBYE` before it closes it on purpose (detach); a link
that ends without it (the notebook's kernel died, its host or the ssh tunnel went) calls
``on_lost`` (the pause then resumes after the job's timeout), with TCP keepalive where the
link is a TCP connection. Messages this rank sends unasked (``{"kind": "exiting"}`` when
the job's process ends normally) go on the same link.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from fsdp_interactive.pool.common import _agent_wire

log = logging.getLogger(__name__)


class NotAttached(PermissionError):
    """A request that needs the attached notebook's session came without it."""


@dataclass
class Session:
    """One attached notebook: its ``id``, what it said of itself (``client``: host, pid,
    user) and when it attached."""

    id: str
    client: dict[str, Any]
    since: float
    link: Connection

    def describe(self) -> str:
        who = self.client
        return (
            f"a notebook (pid {who.get('pid', '?')} on {who.get('host', '?')}) attached "
            f"{time.time() - self.since:.0f} s ago"
        )


class Sessions:
    """This rank's attached notebook (at most one); ``on_lost()`` when its link ends
    without a goodbye, ``on_goodbye()`` when it detaches."""

    def __init__(self, on_lost: Callable[[], None], on_goodbye: Callable[[], None]) -> None:
        self._on_lost = on_lost
        self._on_goodbye = on_goodbye
        self._lock = threading.Lock()
        self.current: Session | None = None

    def open(self, request: dict[str, Any], conn: Connection) -> dict[str, Any] | None:
        """Make ``conn`` the session link of the notebook asking (``None``: accepted, the
        connection is now the session's), or the refusal to send back."""
        session_id = request.get("session")
        if not isinstance(session_id, str) or not session_id:
            return {"refused": "a session needs an id"}
        client = request.get("client") if isinstance(request.get("client"), dict) else {}
        with self._lock:
            held = self.current
            if held is not None and held.id != session_id:
                if _agent_wire.peer_gone(held.link.fileno()):
                    held = None  # its notebook is gone; the watcher will see it too
                elif not request.get("take_over"):
                    return {
                        "refused": f"{held.describe()}; attach with take_over=True "
                        "(%fsdp attach --take-over) to take it over"
                    }
            self.current = Session(session_id, dict(client), time.time(), conn)
        if held is not None:
            log.info("session %s takes over from %s", session_id, held.id)
            with contextlib.suppress(OSError, ValueError):
                held.link.send({"kind": "taken_over", "by": client})
            _agent_wire.shut(held.link)
        if not isinstance(conn.fileno(), int):
            return None
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=conn.fileno())
            try:
                if sock.family != socket.AF_UNIX:
                    _agent_wire.keep_alive(conn.fileno())
            finally:
                sock.detach()
        threading.Thread(
            target=self._watch,
            args=(self.current,),
            name="fsdp-interactive-attach-session",
            daemon=True,
        ).start()
        return None

    def check(self, request: dict[str, Any]) -> Session:
        """The session ``request`` names; :class:`NotAttached` unless it is the current one."""
        current = self.current
        if current is None or request.get("session") != current.id:
            raise NotAttached(
                "this notebook is not attached to the job (another one took it over, or "
                "it detached); attach again"
            )
        return current

    def notify(self, message: dict[str, Any]) -> None:
        """Send ``message`` to the attached notebook, if one is (never raises)."""
        current = self.current
        if current is not None:
            with contextlib.suppress(OSError, ValueError):
                current.link.send(message)

    def end(self, session: Session) -> None:
        """End ``session`` (it detached): no longer current, its link closed."""
        with self._lock:
            if self.current is session:
                self.current = None
        _agent_wire.shut(session.link)

    def _watch(self, session: Session) -> None:
        try:
            message = session.link.recv()
        except (EOFError, OSError):
            message = None
        with self._lock:
            current = self.current is session
            if current:
                self.current = None
        if not current:
            return  # taken over or ended: not this watcher's to report
        if message == _agent_wire.GOODBYE:
            log.info("the notebook detached")
            self._on_goodbye()
        else:
            log.info("the attached notebook went away (its link closed without a goodbye)")
            self._on_lost()
        _agent_wire.shut(session.link)

    def close(self) -> None:
        with self._lock:
            current, self.current = self.current, None
        if current is not None:
            _agent_wire.shut(current.link)
