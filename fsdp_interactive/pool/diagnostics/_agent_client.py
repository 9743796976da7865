"""Kernel side of the diagnostics channel: asking every rank's agent at once.

:class:`RankAgents` holds the agents' addresses (``rank -> (host, port)`` or the path of
a unix socket, as the ranks reported them when they joined) and the pool's channel key
(or each rank's own: an attached job's). Local and remote ranks are asked the same way
(TLS to a TCP agent, :mod:`pool.common._agent_wire`):

* :meth:`RankAgents.ask` sends one request to many ranks concurrently (one thread and
  one fresh authenticated connection per rank) and returns the replies that came within
  the time limit; a rank missing from the result did not answer (its agent cannot get
  the GIL, or the rank is gone).
* :meth:`RankAgents.open_links` opens two long-lived connections per rank (with TCP
  keepalive, so that :meth:`RankAgents.lost` notices a rank that is gone): the *fault
  link*, into which the rank's faulthandler writes its stacks on
  :data:`pool.common._agent_wire.STACK_SIGNAL` (the fallback for ranks whose agent does
  not answer: the C handler needs no GIL), and the *event link*, on which a rank stopped
  at a live breakpoint asks for debugger commands (:meth:`RankAgents.prompts`,
  :meth:`RankAgents.answer`) and ranks send notices unasked
  (:mod:`fsdp_interactive._notices`, read with :meth:`RankAgents.notices`). A notice a
  rank sent before it died is still read: the kernel's socket holds it.

Nothing here signals a rank: :meth:`RankAgents.signal_dumps` is handed the function
that does (the pool signals through ipyparallel's nannies, which run on the ranks'
hosts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as readable_links
from typing import Any

from fsdp_interactive.pool.common import _agent_wire

log = logging.getLogger(__name__)

#: Default limit for an answer: an agent that can run answers in milliseconds.
ASK_TIMEOUT_S = 3.0
_DUMP_QUIET_S = 0.15


class RankAgents:
    """The agents of one running group."""

    def __init__(
        self,
        addresses: Mapping[int, _agent_wire.Address],
        authkey: bytes | Mapping[int, bytes],
        *,
        timeout: float = ASK_TIMEOUT_S,
    ) -> None:
        self.addresses: dict[int, _agent_wire.Address] = {
            rank: a if isinstance(a, str) else (str(a[0]), int(a[1]))
            for rank, a in addresses.items()
        }
        # One key for every rank (a pool's), or each rank its own (an attached job's).
        self._keys = (
            dict(authkey)
            if isinstance(authkey, Mapping)
            else dict.fromkeys(self.addresses, authkey)
        )
        self.timeout = timeout
        self._fault: dict[int, Connection] = {}
        self._events: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._prompts: list[dict[str, Any]] = []
        self._notices: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ requests

    def ask_one(self, rank: int, request: dict[str, Any], timeout: float | None = None) -> Any:
        """One rank's reply to ``request``; raises ``OSError`` when it does not answer in time."""
        limit = self.timeout if timeout is None else timeout
        conn = _agent_wire.connect(self.addresses[rank], self._keys[rank], limit)
        try:
            _agent_wire.send(conn, request)
            reply = conn.recv()
        finally:
            conn.close()
        if isinstance(reply, dict) and "error" in reply and len(reply) == 1:
            raise RuntimeError(f"rank {rank}'s agent failed: {reply['error']}")
        return reply

    def ask(
        self, ranks: Sequence[int], request: dict[str, Any], timeout: float | None = None
    ) -> dict[int, Any]:
        """Replies of those ``ranks`` that answered ``request`` within ``timeout`` seconds."""
        limit = self.timeout if timeout is None else timeout
        ranks = [rank for rank in ranks if rank in self.addresses]
        if not ranks:
            return {}
        began = time.monotonic()
        pool = ThreadPoolExecutor(max_workers=min(32, len(ranks)), thread_name_prefix="fsdpi-ask")
        try:
            futures = {pool.submit(self.ask_one, rank, request, limit): rank for rank in ranks}
            done, _ = wait(futures, timeout=limit + 1.0)
        finally:
            pool.shutdown(wait=False)  # a silent agent's thread ends at its socket's limit
        replies: dict[int, Any] = {}
        for future in done:
            rank = futures[future]
            try:
                replies[rank] = future.result()
            except Exception as error:
                log.debug("rank %d's agent did not answer %r: %s", rank, request.get("op"), error)
        log.debug(
            "%r answered by ranks %s of %s in %.3fs",
            request.get("op"),
            sorted(replies),
            ranks,
            time.monotonic() - began,
        )
        return replies

    def hold_watchdogs(self, name: str, seconds: float | None) -> list[int]:
        """Hold the NCCL watchdog's clock on every rank (:mod:`pool.rank._watchdog_hold`):
        hold ``name`` for ``seconds`` (``None``: until released; 0 releases it). Returns
        the ranks that answered; a rank that did not is left as it was."""
        request = {"op": "hold_watchdog", "name": name, "seconds": seconds}
        return sorted(self.ask(list(self.addresses), request))

    # ------------------------------------------------------------------ long-lived links

    def open_links(self) -> None:
        """Open the fault and event links of every rank (concurrently; failures are logged)."""

        def link(rank: int, kind: str) -> tuple[int, str, Connection]:
            address = self.addresses[rank]
            # A fault link stays plain: faulthandler writes into its socket (it carries
            # code locations, no values); everything else to a TCP agent is encrypted.
            secure = kind != "fault_link" and not _agent_wire.is_unix(address)
            conn = _agent_wire.connect(address, self._keys[rank], self.timeout, secure=secure)
            conn.send({"op": kind})
            reply = conn.recv()
            if not (isinstance(reply, dict) and reply.get("ok")):
                conn.close()
                raise RuntimeError(f"rank {rank} refused the {kind}: {reply!r}")
            _agent_wire.set_timeout(conn.fileno(), self.timeout)
            _agent_wire.keep_alive(conn.fileno())
            return rank, kind, conn

        jobs = [(rank, kind) for rank in self.addresses for kind in ("fault_link", "event_link")]
        with ThreadPoolExecutor(max_workers=min(32, len(jobs))) as pool:
            futures = [pool.submit(link, rank, kind) for rank, kind in jobs]
        for future in futures:
            try:
                rank, kind, conn = future.result()
            except Exception as error:
                log.debug("could not open a link: %s", error)
                continue
            (self._fault if kind == "fault_link" else self._events)[rank] = conn

    def lost(self) -> list[int]:
        """Ranks whose fault link was closed by the rank's side or broke: the rank's
        process ended (its host closes its sockets) or its host stopped answering (TCP
        keepalive, see :mod:`pool.common._agent_wire`). Ranks without a link are never listed."""
        with self._lock:
            links = dict(self._fault)
        return sorted(rank for rank, conn in links.items() if _agent_wire.peer_gone(conn.fileno()))

    def signal_dumps(
        self, ranks: Sequence[int], send_signal: Callable[[list[int]], None], wait_s: float
    ) -> dict[int, str]:
        """faulthandler's text from ``ranks`` after ``send_signal(ranks)``; ranks without a
        fault link or that wrote nothing within ``wait_s`` are missing from the result."""
        linked = [rank for rank in ranks if rank in self._fault]
        if not linked:
            return {}
        for rank in linked:
            _drain(self._fault[rank])
        send_signal(linked)
        received: dict[int, bytearray] = {rank: bytearray() for rank in linked}
        last_data: dict[int, float] = {}
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            rank_of = {id(self._fault[r]): r for r in linked}
            # wait() polls, so descriptors above select()'s FD_SETSIZE work too (a kernel
            # that has run for a while holds more than 1024).
            readable = readable_links([self._fault[r] for r in linked], timeout=0.05)
            now = time.monotonic()
            for conn in readable:
                rank = rank_of[id(conn)]
                chunk = os.read(conn.fileno(), 65536)
                if chunk:
                    received[rank] += chunk
                    last_data[rank] = now
            quiet = all(r in last_data and now - last_data[r] > _DUMP_QUIET_S for r in linked)
            if quiet:
                break
        return {
            rank: bytes(data).decode(errors="replace") for rank, data in received.items() if data
        }

    def prompts(self) -> list[dict[str, Any]]:
        """Debugger messages ranks sent on their event links, without waiting: ``kind``
        ``"prompt"`` (answer with :meth:`answer`) or ``"output"`` (only to be shown)."""
        with self._lock:
            self._read_events()
            found, self._prompts = self._prompts, []
        return found

    def notices(self) -> list[dict[str, Any]]:
        """The notices ranks sent since the last call (each with the sending ``rank``
        added), without waiting; debugger prompts read meanwhile wait for :meth:`prompts`."""
        with self._lock:
            self._read_events()
            found, self._notices = self._notices, []
        return found

    def _read_events(self) -> None:
        """Move every message waiting on the event links into the prompt or notice list;
        the caller holds the lock."""
        # One zero-timeout select over every link: this runs between the polls of a
        # waiting call, and a poll per link would cost one system call per rank each time.
        try:
            ready = set(readable_links(list(self._events.values()), timeout=0))
        except (OSError, ValueError):  # a broken link: each is read below, and dropped
            ready = set(self._events.values())
        for rank, conn in list(self._events.items()):
            if conn not in ready:
                continue
            try:
                while conn.poll(0):
                    message = conn.recv()
                    kind = message.get("kind") if isinstance(message, dict) else None
                    if kind in ("prompt", "output"):
                        self._prompts.append(message)
                    elif kind == "notice" and isinstance(message.get("notice"), dict):
                        self._notices.append({**message["notice"], "rank": rank})
            except (EOFError, OSError):
                log.debug("rank %d's event link closed", rank)
                del self._events[rank]

    def answer(self, rank: int, command: str) -> None:
        """Send the debugger ``command`` the user typed for ``rank``."""
        with self._lock:
            conn = self._events.get(rank)
            if conn is not None:
                conn.send({"command": command})

    def close(self) -> None:
        """Close every link; the ranks are told first (:data:`pool.common._agent_wire.GOODBYE`),
        so that a rank watching for its kernel's end does not take this for it."""
        for conn in self._fault.values():
            with contextlib.suppress(OSError, ValueError):
                conn.send(_agent_wire.GOODBYE)
        for conn in [*self._fault.values(), *self._events.values()]:
            with contextlib.suppress(OSError):
                conn.close()
        self._fault, self._events = {}, {}


def _drain(conn: Connection) -> None:
    """Discard what a fault link holds already (a dump nobody waited for)."""
    while conn.poll(0):
        if not os.read(conn.fileno(), 65536):
            return
