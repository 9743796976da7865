"""The notebook's links to the ranks of one attached job.

Each rank is reached where its record says (:mod:`fsdp_interactive._attach_records`): its
Unix socket on this host; on another host through one ssh tunnel per host
(:class:`pool.processes._ssh_tunnel.SshTunnel`: local sockets in a private folder of this
kernel's host) or, where the job listens on TCP (``--listen``), at that address. Every
connection passes the rank's HMAC challenge under the rank's own key
(:mod:`pool.common._agent_wire`); requests go through :class:`RankAgents` (one
connection per request and rank, all ranks at once).

The *session links* (one per rank, kept open) make this notebook the job's attached one
(:mod:`pool.rank._attach_session`): a rank whose link closes without the rank saying it
exits has died (:meth:`JobLinks.gone`); another notebook that takes the job over is said
on them too. :meth:`JobLinks.close` says goodbye on every link, so that no rank takes the
detach for a notebook that went away, then ends the tunnels.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

from fsdp_interactive import _private_files
from fsdp_interactive.pool._attach_errors import AttachError
from fsdp_interactive.pool._attach_find import FoundJob
from fsdp_interactive.pool.common import _agent_wire
from fsdp_interactive.pool.diagnostics._agent_client import RankAgents
from fsdp_interactive.pool.processes._ssh_tunnel import SshTunnel

log = logging.getLogger(__name__)

#: How long a rank may take to answer: more than a pool's agents get, as a job's ranks
#: share their hosts with the job's own work (data loaders, compilation) at full load.
ANSWER_TIMEOUT_S = 10.0


class JobLinks:
    """Links to every rank of ``found`` (see the module); ``ssh_args`` for the tunnels."""

    def __init__(
        self, found: FoundJob, *, ssh_args: Sequence[str] = (), timeout: float = ANSWER_TIMEOUT_S
    ):
        self.job = found.name
        self.records = {r.rank: r for r in found.records}
        self._tunnels: list[SshTunnel] = []
        self._folder: str | None = None
        self._links: dict[int, Connection] = {}
        self._said: dict[int, list[dict[str, Any]]] = {}
        self._requests: dict[int, Connection] = {}
        self._request_locks = {rank: threading.Lock() for rank in self.records}
        self._pool = ThreadPoolExecutor(
            max_workers=min(32, max(1, len(self.records))), thread_name_prefix="fsdpi-job"
        )
        addresses: dict[int, _agent_wire.Address] = {}
        by_host: dict[str, list[tuple[str, str]]] = {}
        for rank, record in self.records.items():
            if record.host not in found.remote:
                if record.socket is None:
                    raise AttachError(f"rank {rank} of job {self.job} has no socket on this host")
                addresses[rank] = record.socket
            elif record.address is not None:
                addresses[rank] = record.address
            else:
                local = os.path.join(self._private_folder(), f"r{rank}.sock")
                by_host.setdefault(found.remote[record.host], []).append(
                    (local, str(record.socket))
                )
                addresses[rank] = local
        try:
            for host, forwards in by_host.items():
                tunnel = SshTunnel(host, ssh_args, forwards)
                tunnel.start()
                self._tunnels.append(tunnel)
        except OSError as error:
            self.close()
            raise AttachError(str(error)) from None
        self.agents = RankAgents(
            addresses, {r: rec.key_bytes for r, rec in self.records.items()}, timeout=timeout
        )

    def _private_folder(self) -> str:
        if self._folder is None:
            # A short path: a Unix socket's path is limited to 107 bytes.
            self._folder = tempfile.mkdtemp(
                prefix="fsdpi-attach-", dir="/tmp" if os.path.isdir("/tmp") else None
            )
            _private_files.check_private_folder(self._folder)
        return self._folder

    @property
    def ranks(self) -> list[int]:
        return sorted(self.records)

    def open_sessions(self, request: dict[str, Any]) -> dict[int, Any]:
        """Open the session link of every rank with ``request`` (``op`` ``"session"``);
        every rank's first answer. :class:`AttachError` (and nothing left open) when a
        rank refuses, cannot be reached or proves a different key."""

        def open_one(rank: int) -> tuple[int, Connection, Any]:
            conn = _agent_wire.connect(
                self.agents.addresses[rank], self.records[rank].key_bytes, 30.0
            )
            conn.send(request)
            return rank, conn, conn.recv()

        failures: dict[int, str] = {}
        answers: dict[int, Any] = {}
        with ThreadPoolExecutor(max_workers=min(32, len(self.records))) as pool:
            futures = {pool.submit(open_one, rank): rank for rank in self.ranks}
        for future, rank in futures.items():
            try:
                _, conn, answer = future.result()
            except AuthenticationError:
                failures[rank] = "it refused the key of its record (the record is not this job's)"
                continue
            except (OSError, EOFError) as error:
                failures[rank] = f"cannot be reached ({error})"
                continue
            if not (isinstance(answer, dict) and answer.get("ok")):
                conn.close()
                failures[rank] = str(answer.get("refused") if isinstance(answer, dict) else answer)
                continue
            _agent_wire.set_timeout(conn.fileno(), 10.0)
            self._links[rank] = conn
            answers[rank] = answer
        if failures:
            self.close()
            first = sorted(set(failures.values()))
            ranks = sorted(failures)
            raise AttachError(
                f"could not attach to job {self.job}: rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))}: {'; '.join(first)}"
            )
        return answers

    def ask(
        self, ranks: Sequence[int], request: dict[str, Any], timeout: float | None = None
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """``request`` to every rank of ``ranks`` at once: ``(replies, failures)``, a
        failure being what the rank raised or why it did not answer in time.

        Each rank's requests go over one kept connection (authenticated once): a fresh
        connection per request costs a handshake of four messages, each of which waits
        for the rank's agent thread to get the interpreter from the training thread."""
        limit = self.agents.timeout if timeout is None else timeout
        replies: dict[int, Any] = {}
        failures: dict[int, str] = {}
        futures = {rank: self._pool.submit(self._ask_one, rank, request, limit) for rank in ranks}
        for rank, future in futures.items():
            try:
                replies[rank] = future.result()
            except Exception as error:
                text = str(error)
                failures[rank] = (
                    text.split("agent failed: ", 1)[-1]
                    if "agent failed" in text
                    else (f"no answer ({type(error).__name__}: {text})")
                )
        return replies, failures

    def _ask_one(self, rank: int, request: dict[str, Any], limit: float) -> Any:
        with self._request_locks[rank]:
            conn = self._requests.get(rank)
            if conn is None:
                conn = _agent_wire.connect(
                    self.agents.addresses[rank], self.records[rank].key_bytes, limit
                )
                self._requests[rank] = conn
            try:
                _agent_wire.set_timeout(conn.fileno(), limit)
                _agent_wire.send(conn, request)
                reply = conn.recv()
            except BaseException:
                del self._requests[rank]  # a broken or late answer: never reused
                conn.close()
                raise
        if isinstance(reply, dict) and "error" in reply and len(reply) == 1:
            raise RuntimeError(f"rank {rank}'s agent failed: {reply['error']}")
        return reply

    def said(self) -> dict[int, list[dict[str, Any]]]:
        """What every rank sent unasked on its link so far (``exiting``, ``taken_over``)."""
        for rank, conn in self._links.items():
            with contextlib.suppress(OSError, EOFError, ValueError):
                while conn.poll(0):
                    message = conn.recv()
                    if isinstance(message, dict):
                        self._said.setdefault(rank, []).append(message)
        return self._said

    def take_notices(self) -> list[dict[str, Any]]:
        """The notices ranks sent (:mod:`fsdp_interactive._notices`, a snapshot's record),
        each once, oldest first."""
        taken = []
        for messages in self.said().values():
            for message in [m for m in messages if m.get("kind") == "notice"]:
                messages.remove(message)
                if isinstance(message.get("notice"), dict):
                    taken.append(message["notice"])
        return taken

    def gone(self) -> dict[int, str]:
        """Ranks whose link closed: ``"exited"`` (the rank said so first) or ``"died"``;
        ranks taken over by another notebook: ``"taken over"``."""
        said = self.said()
        found = {}
        for rank, conn in self._links.items():
            kinds = {m.get("kind") for m in said.get(rank, [])}
            if "taken_over" in kinds:
                found[rank] = "taken over"
            elif _agent_wire.peer_gone(conn.fileno()):
                found[rank] = "exited" if "exiting" in kinds else "died"
        return found

    def close(self, goodbye: bool = True) -> None:
        """Say goodbye on every link (unless not ``goodbye``), close them, end the tunnels."""
        links, self._links = self._links, {}
        requests, self._requests = self._requests, {}
        for conn in requests.values():
            with contextlib.suppress(OSError):
                conn.close()
        self._pool.shutdown(wait=False)
        for conn in links.values():
            if goodbye:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(_agent_wire.GOODBYE)
            with contextlib.suppress(OSError):
                conn.close()
        for tunnel in self._tunnels:
            tunnel.stop()
        self._tunnels = []
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
