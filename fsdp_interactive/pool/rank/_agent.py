"""Rank side: the diagnostics agent, a small authenticated server inside every rank.

The kernel learns about a rank through it (stacks, recent collectives, native frames,
the debugger) while the rank's main thread runs a cell or is blocked inside a C++
collective, and whether the rank runs on the kernel's host or on another one: nothing
is read from a file.

Why an agent of our own and not torch's worker server (``torch.distributed.debug``):
torch's exists only from torch 2.13 (the package supports 2.9 .. 2.14), binds all
interfaces by default, has no authentication (documented as unsafe on untrusted
networks), registers itself in the c10d store and serves through an HTTP frontend on
rank 0 that needs Jinja2 and aiohttp. The pool's channel must also carry the debugger,
which evaluates code on the rank: it has to be authenticated. This agent is one daemon
thread per rank, listening where the pool tells it: in a single-host pool on a unix
socket in the pool's private socket folder
(:mod:`fsdp_interactive.pool.common._socket_folder`; no other local user can connect to
it, where any could to a loopback port), across hosts on the rank's cluster address; and
every connection must pass an HMAC challenge in both directions
(:mod:`pool.common._agent_wire`) with a key derived per pool start from the cluster's
HMAC key, which never travels.

Requests are dicts with an ``"op"``; each connection is served on its own thread, so a
slow answer (py-spy) does not hold up another:

* ``ping`` -> ``{"pid", "rank"}``;
* ``stacks`` (``native``: add py-spy's native frames of the user thread; ``trace``: add
  the last N flight-recorder entries) -> ``{"threads": [ThreadStack], "native",
  "native_error", "trace": RecorderDump | None}``;
* ``trace`` (``last``, ``issued_at``: also the line that issued each collective, slow
  the first time) -> ``{"trace": RecorderDump}``;
* ``debug`` (``command``) -> one post-mortem pdb command (:mod:`._debugger`);
* ``hold_watchdog`` (``name``, ``seconds``: ``None`` until released, 0 releases) ->
  ``{"holds": [names]}``: hold
  the NCCL watchdog's clock on this rank (:mod:`._watchdog_hold`) while a person debugs
  this rank or a peer;
* ``fault_link``: this connection becomes the target of faulthandler's dump on
  :data:`STACK_SIGNAL` (the fallback for a rank whose agent cannot answer because a
  thread holds the GIL: the C signal handler writes without it). With
  ``end_with_owner`` the link also tells that the kernel is gone: the kernel sends
  :data:`pool.common._agent_wire.GOODBYE` on it before it closes it; a link that closes
  or breaks (TCP keepalive) without it means the kernel died, and the rank process exits (status
  :data:`OWNER_GONE_EXIT`) — even while its main thread is blocked in a collective,
  where no controller heartbeat would end it;
* ``event_link``: this connection becomes the rank's line to the kernel, on which a
  live breakpoint asks for debugger commands.

The agent needs the GIL to answer; a rank whose C code holds the GIL does not answer,
and the kernel falls back to the signal. On TCP (ranks on several hosts, an attachable
job's ``--listen``) every connection but the fault link is encrypted (TLS,
:mod:`pool.common._secure_link`); the fault link stays plain, because faulthandler writes
its dump straight into the socket, and carries code locations only.

Other servers built on the agent (an attachable job's, :mod:`._attach_service`) hand it
a socket that already listens (``listener``: a unix socket in a private folder, say) and
``handlers``: ops of their own, asked before the ones above, each called with the request
and its connection; a handler that keeps the connection (a long-lived link) returns
:data:`KEPT`. On TCP they are answered over TLS only, as the agent's own.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from fsdp_interactive.pool.common import _agent_wire
from fsdp_interactive.pool.common._agent_wire import STACK_SIGNAL
from fsdp_interactive.pool.common._socket_folder import socket_path
from fsdp_interactive.pool.rank._thread_stacks import CodeName

log = logging.getLogger(__name__)

#: Exit status of a rank whose kernel is gone.
OWNER_GONE_EXIT = 75
#: What a handler returns when it keeps the connection it was given (nothing is sent).
KEPT = object()
#: ``handler(request, connection)``: a reply dict, or :data:`KEPT`.
Handler = Callable[[dict[str, Any], Connection], Any]


class RankAgent:
    """One rank's agent: a listening socket and the thread that accepts on it.

    ``user_thread``: ident of the thread that runs user code; ``code_name(filename)``
    labels notebook cell code; ``rank()`` tells the rank once the group formed;
    ``end_with_owner``: exit when the kernel's fault link ends without
    :data:`pool.common._agent_wire.GOODBYE`. ``host``: the address to listen on (a fresh
    TCP port), or the socket folder to listen in (an absolute path: a unix socket there).
    ``listener``: a listening socket to serve on instead (``host`` is then unused);
    ``handlers``: ops of the caller's own (see the module).
    """

    def __init__(
        self,
        host: str,
        authkey: bytes,
        *,
        user_thread: int,
        code_name: CodeName | None = None,
        rank: Callable[[], int] = lambda: -1,
        end_with_owner: bool = False,
        listener: socket.socket | None = None,
        handlers: Mapping[str, Handler] | None = None,
    ) -> None:
        self.authkey = authkey
        self.end_with_owner = end_with_owner
        self.user_thread = user_thread
        self.code_name = code_name
        self.rank = rank
        self.handlers = dict(handlers or {})
        #: The unix socket this agent made in a socket folder (removed when it closes).
        self._unix_path: str | None = None
        self._sock = listener if listener is not None else self._listen(host)
        name = self._sock.getsockname()
        #: ``(host, port)``, or the path of a unix socket.
        self.address: _agent_wire.Address = name if isinstance(name, str) else name[:2]
        self._links: dict[str, Connection] = {}
        self._events: EventLink | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name="fsdp-interactive-agent", daemon=True
        )
        self._thread.start()

    def _listen(self, host: str) -> socket.socket:
        """A fresh listening socket: a unix socket in the socket folder ``host`` names (an
        absolute path), else a fresh TCP port on the address ``host``."""
        if os.path.isabs(host):  # the pool's socket folder
            self._unix_path = socket_path(host, f"agent-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)  # an earlier group's agent of this process
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(self._unix_path)
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
        sock.listen(64)
        return sock

    # ------------------------------------------------------------------ serving

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(sock,), name="fsdp-interactive-agent-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            conn = _agent_wire.accept(sock, self.authkey)
        except Exception as error:  # a peer without the key, or one that went silent
            log.debug("diagnostics connection refused: %s", error)
            return
        try:
            while True:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    return
                op = request.get("op") if isinstance(request, dict) else None
                if not self._may_answer(conn, op):
                    _agent_wire.send(
                        conn, {"error": f"{op!r} is answered only over TLS on this agent"}
                    )
                    continue
                handler = self.handlers.get(op) if isinstance(op, str) else None
                if handler is not None:
                    try:
                        reply = handler(request, conn)
                    except Exception as error:
                        reply = {"error": f"{type(error).__name__}: {error}"}
                    if reply is KEPT:
                        conn = None  # type: ignore[assignment]  # the handler owns it now
                        return
                    _agent_wire.send(conn, reply)
                    continue
                if op in ("fault_link", "event_link"):
                    self._keep_link(op, conn)
                    conn.send({"ok": True})
                    conn = None  # type: ignore[assignment]  # kept; not closed here
                    return
                try:
                    reply = self.answer(op, request)
                except Exception as error:
                    reply = {"error": f"{type(error).__name__}: {error}"}
                _agent_wire.send(conn, reply)
        finally:
            if conn is not None:
                conn.close()

    def _may_answer(self, conn: Any, op: Any) -> bool:
        """A TCP agent answers a plain connection (no TLS) with a fault link only: what it
        carries names code, never values (:mod:`pool.common._agent_wire`)."""
        return (
            self._sock.family == socket.AF_UNIX
            or getattr(conn, "secure", False)
            or op in _agent_wire.PLAIN_OPS
        )

    def answer(self, op: Any, request: dict[str, Any]) -> dict[str, Any]:
        """The reply to one of the agent's own requests (see the module)."""
        from fsdp_interactive.pool.rank import (
            _debugger,
            _thread_stacks,
            _torch_recorder,
            _watchdog_hold,
        )

        if op == "ping":
            return {"pid": os.getpid(), "rank": self.rank()}
        if op == "stacks":
            threads = _thread_stacks.capture(self.user_thread, self.code_name)
            reply: dict[str, Any] = {"threads": threads, "native": None, "native_error": None}
            if request.get("native"):
                user = next((t for t in threads if t.user), None)
                native_id = user.native_id if user is not None else None
                reply["native"], reply["native_error"] = _thread_stacks.native_stack(native_id)
            if request.get("trace") is not None:
                reply["trace"] = _torch_recorder.dump(request["trace"], self.code_name)
            return reply
        if op == "trace":
            trace = _torch_recorder.dump(
                request.get("last"), self.code_name, issued_at=bool(request.get("issued_at"))
            )
            return {"trace": trace}
        if op == "debug":
            return _debugger.post_mortem(request.get("command"), self.code_name)
        if op == "hold_watchdog":
            seconds = request.get("seconds")
            _watchdog_hold.hold(str(request["name"]), None if seconds is None else float(seconds))
            return {"holds": _watchdog_hold.active()}
        raise ValueError(f"unknown request {op!r}")

    def _keep_link(self, kind: str, conn: Connection) -> None:
        old = self._links.pop(kind, None)
        self._links[kind] = conn
        if kind == "event_link":
            self._events = EventLink(conn)
        if kind == "fault_link":
            # The C handler writes the dump straight into this socket, without the GIL.
            faulthandler.register(STACK_SIGNAL, file=conn, all_threads=True, chain=False)
            if self.end_with_owner:
                threading.Thread(
                    target=self._watch_owner,
                    args=(conn,),
                    name="fsdp-interactive-owner-watch",
                    daemon=True,
                ).start()
        if old is not None:
            _shut(old)

    def _watch_owner(self, conn: Connection) -> None:
        """Exit the process when ``conn`` (the fault link) ends without a goodbye."""
        _agent_wire.keep_alive(conn.fileno())
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        if (
            message == _agent_wire.GOODBYE
            or self._closed
            or self._links.get("fault_link") is not conn
        ):
            return
        os.write(
            2,
            b"fsdp-interactive: the kernel that owns this pool is gone (its link to this "
            b"rank closed without a goodbye); the rank exits\n",
        )
        os._exit(OWNER_GONE_EXIT)

    # ------------------------------------------------------------------ rank-side use

    def event_link(self) -> EventLink | None:
        """The link on which the rank sends debugger prompts and notices and the kernel
        answers prompts (None: no kernel)."""
        return self._events

    def notify(self, notice: dict[str, Any]) -> None:
        """Send ``notice`` (see :mod:`fsdp_interactive._notices`) to the kernel; raises
        ``OSError`` when no kernel listens."""
        link = self._events
        if link is None:
            raise OSError("no kernel listens on this rank's event link")
        link.send({"kind": "notice", "notice": notice})

    def close(self) -> None:
        self._closed = True
        _park_fault_handler()
        self._events = None
        links, self._links = self._links, {}
        for conn in links.values():
            _shut(conn)
        self._sock.close()
        if self._unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)


class EventLink:
    """The event link's connection, whose sends may come from several threads (a debugger
    prompt from the user's thread, a notice from a background snapshot) and must not
    interleave on the wire."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._send_lock:
            self._conn.send(message)

    def recv(self) -> Any:
        return self._conn.recv()


_shut = _agent_wire.shut


_AGENT: RankAgent | None = None
_PARKED: Any = None


def _park_fault_handler() -> None:
    """Keep :data:`STACK_SIGNAL` harmless when no fault link is open (its default action
    would end the process): the dump then goes nowhere."""
    global _PARKED
    if _PARKED is None:
        _PARKED = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    faulthandler.register(STACK_SIGNAL, file=_PARKED, all_threads=True, chain=False)


def start(
    host: str,
    authkey: bytes,
    *,
    user_thread: int | None = None,
    code_name: CodeName | None = None,
    rank: Callable[[], int] = lambda: -1,
    end_with_owner: bool = False,
) -> _agent_wire.Address:
    """Start this process's agent on ``host`` (a fresh port), or in the socket folder
    ``host`` names (an absolute path: a unix socket there); its ``(host, port)``, or the
    path of its unix socket.

    A running agent is replaced (a restarted pool brings a new key). ``user_thread``
    defaults to the calling thread; ``end_with_owner``: see :class:`RankAgent`.
    """
    global _AGENT
    stop()
    _park_fault_handler()
    _AGENT = RankAgent(
        host,
        authkey,
        user_thread=threading.get_ident() if user_thread is None else user_thread,
        code_name=code_name,
        rank=rank,
        end_with_owner=end_with_owner,
    )
    log.debug("diagnostics agent listening on %s", _AGENT.address)
    return _AGENT.address


def stop() -> None:
    """Stop this process's agent, if one runs."""
    global _AGENT
    if _AGENT is not None:
        _AGENT.close()
        _AGENT = None


def current() -> RankAgent | None:
    """This process's agent (None when none runs)."""
    return _AGENT
