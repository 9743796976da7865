"""Turning registered engines into one ``torch.distributed`` process group.

The steps after the engines are up (launched by :mod:`pool.processes._launched`, or those of a
cluster the pool connected to), each a call on the engines into
:mod:`pool.rank._bootstrap`:

1. wait until ``n`` engines registered with the controller, as the controller counts them,
   each engine that is lost started once more (:mod:`pool._registration`);
2. describe the engines (host, address, pid, and their CUDA device counts when the
   placement needs them), assign ranks (:mod:`pool.common._topology`) and settle the
   placement from those reports (:func:`pool._placement.settle`);
3. rank 0 opens the rendezvous store: with every rank on one host a ``FileStore`` in the
   pool's private snapshot root (no other local user can reach it), with ranks on
   several hosts a ``TCPStore`` on a port it binds itself (no free-port race; torch's
   store authenticates nothing, so the hosts' network must be trusted);
4. all ranks start their diagnostics agent (:mod:`pool.rank._agent`, through the engine
   hooks of :mod:`pool.rank._engine_shell`), then call ``init_process_group`` concurrently on
   the store, count themselves in on it, wait for the full count and check the
   backend with one ``all_reduce``;
5. every rank's namespace gets ``torch``, ``dist``, ``rank``, ``world_size``,
   ``local_rank`` and ``device``.

A single-host group keeps gloo's and NCCL's listeners on loopback, its agents' in the
pool's private socket folder (when it has one: a pool that started its engines), and its
store in a file. With ranks on several hosts, ``MASTER_ADDR`` is rank 0's address, the store
listens on that address only, each agent on its rank's address, and each rank binds
gloo (and NCCL) to the interface that holds its address (see
:func:`pool.rank._bootstrap.bind_collective_sockets`). The agents' key is
derived from the cluster's HMAC key and a nonce that :attr:`Group.nonce` holds (the key
itself never travels).

Every step is bounded by the start-up timeout and gives up at the first failing engine
or the first engine process that exits (peers might wait for it forever); the failure
is a :class:`~.errors.PoolStartError`. Records the ranks log while joining are shown,
tagged by rank, when the pool has a log level. Not done here: stopping anything on
failure (the pool stops what it started).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ipyparallel as ipp

from fsdp_interactive.pool._call_output import send_requests
from fsdp_interactive.pool._output import OutputPump, TaggedPrinter
from fsdp_interactive.pool._placement import Placement, settle
from fsdp_interactive.pool._registration import Registration
from fsdp_interactive.pool.common import _agent_wire, _hosts, _snapshot_root
from fsdp_interactive.pool.common._topology import RankRecord, RankSlot, assign_ranks
from fsdp_interactive.pool.diagnostics._diagnosis import traceback_text
from fsdp_interactive.pool.errors import PoolStartError, describe_exit
from fsdp_interactive.pool.processes._launched import EngineProcess, LaunchedProcesses
from fsdp_interactive.pool.rank import _bootstrap as rank_side
from fsdp_interactive.pool.rank import _engine_shell
from fsdp_interactive.pool.rank._bootstrap import SOCKET_IFNAME_VARS

log = logging.getLogger(__name__)

_POLL_S = 0.05
#: How long a start-up step that saw an engine die waits for its process's end to show.
_EXIT_NOTICE_S = 2.0

NAMESPACE_SETUP = """\
import torch
import torch.distributed as dist
from fsdp_interactive.pool.rank._bootstrap import rank_context as _fsdpi_rank_context
rank, world_size, local_rank, device = _fsdpi_rank_context()
device = torch.device(device)
del _fsdpi_rank_context
"""


def _engine_death(exc: Exception) -> bool:
    """Whether ipyparallel failed a request because its engine died (raised as is, or as
    the ``RemoteError`` an ``AsyncResult`` carries it in)."""
    return isinstance(exc, ipp.error.EngineError) or getattr(exc, "ename", None) == "EngineError"


def _exited(engine: EngineProcess, when: str) -> str:
    """What a start-up error says of an engine that ended: its pid, how it ended, when,
    and the last lines of its log (where a crash report or a traceback is)."""
    return (
        f"engine process {engine.pid} exited {when} ({describe_exit(engine.exit_code())}); "
        "last lines of its log:\n" + engine.output_tail()
    )


@dataclass
class Group:
    """A formed process group: one record and one view per rank, and what the
    diagnostics need: each rank's user thread, agent address and flight-recorder note
    (``None``: it records), and the nonce the agents' key was derived with."""

    records: list[RankRecord] = field(default_factory=list)
    views: dict[int, Any] = field(default_factory=dict)
    thread_ids: dict[int, int] = field(default_factory=dict)
    agents: dict[int, _agent_wire.Address] = field(default_factory=dict)
    recorder_notes: dict[int, str | None] = field(default_factory=dict)
    nonce: bytes = b""
    #: Each rank's parent process (on its host), as the rank reported it.
    parent_pids: dict[int, int] = field(default_factory=dict)


class Rendezvous:
    """The start-up steps on the engines of ``client``.

    ``timeout`` bounds each step; ``launched``: the processes the pool started for these
    engines (``None`` for a cluster it connected to), which tell of engine processes that
    ended, of launchers that can no longer bring more engines and where the launchers
    stand, for the errors of a start that fails; ``log_level``: the ranks' log level
    (``None``: leave their logging alone);
    ``flight_recorder``: ring-buffer entries of torch's flight recorder on each rank
    (0: off; ``None``: the environment's ``TORCH_FR_BUFFER_SIZE``, else torch's default);
    ``check_collectives``: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on the ranks;
    ``engine_env``: variables set in every rank's environment as it joins (the pool's
    snapshot root). Ranks of launched engines exit when this kernel is gone (see
    :mod:`pool.rank._agent`). ``socket_folder``: the pool's private socket folder on
    this host, where the agents of a single-host group listen (``None``: on loopback).
    """

    def __init__(
        self,
        client: Any,
        *,
        timeout: float,
        pg_timeout: float,
        launched: LaunchedProcesses | None,
        log_level: int | None = None,
        flight_recorder: int | None = None,
        check_collectives: bool = False,
        engine_env: Mapping[str, str] | None = None,
        socket_folder: str | None = None,
    ) -> None:
        self._client = client
        self._socket_folder = socket_folder
        self._engine_env = dict(engine_env or {})
        self._launched = launched
        self._owned = launched is not None
        self._timeout = timeout
        self._pg_timeout = pg_timeout
        self._log_level = log_level
        self._flight_recorder = flight_recorder
        self._check_collectives = check_collectives

    @property
    def client(self) -> Any:
        """The client the steps use (a registration wait may have replaced the first)."""
        return self._client

    def wait_for_engines(
        self,
        n: int,
        deadline: float,
        *,
        reconnect: Callable[[float], Any] | None = None,
        on_count: Callable[[int], None] | None = None,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        """Wait until ``n`` engines registered (``deadline``: a ``time.monotonic()``), as
        the controller counts them, retrying an engine that is lost once
        (:mod:`pool._registration`; ``reconnect(timeout)``: a new client of the cluster,
        ``on_count(k)``: the count changed, ``notice(text)``: a retry to tell)."""
        waiting = Registration(
            self._client,
            n,
            timeout=self._timeout,
            reconnect=reconnect,
            launched=self._launched,
            on_count=on_count,
            notice=notice,
        )
        try:
            waiting.wait(deadline)
        finally:
            self._client = waiting.client  # the one left open, for the caller to close

    def form_group(self, n: int, placement: Placement) -> Group:
        """Make the first ``n`` registered engines ranks of a new default process group."""
        client = self._client
        engine_ids = sorted(client.ids)[:n]
        if self._log_level is not None:
            self.gather(
                {
                    eid: client[eid].apply_async(rank_side.enable_logging, self._log_level)
                    for eid in engine_ids
                },
                "setting the engines' log level",
            )
        count_cuda = placement.devices is not None
        described = self.gather(
            {
                eid: client[eid].apply_async(rank_side.describe_engine, count_cuda)
                for eid in engine_ids
            },
            "describing engines",
        )
        refuse_other_versions(described)
        slots = assign_ranks(described)
        placement = settle(placement, host_reports(slots, described))
        log.debug("placement: %s", placement)
        group = Group(views={slot.rank: client[slot.engine_id] for slot in slots})
        group.parent_pids = {
            slot.rank: int(described[slot.engine_id].get("parent_pid") or 0) for slot in slots
        }

        single_host = len({slot.host for slot in slots}) == 1
        master_addr = "127.0.0.1" if single_host else slots[0].address
        nonce = secrets.token_bytes(16)
        group.nonce = nonce
        # One host: a file in the pool's private root, which no other local user reaches
        # (a TCPStore on loopback accepts any). Several: torch's TCPStore server, which
        # listens on every interface whatever host it is given; the socket rank 0 binds
        # itself (passed as master_listen_fd) decides.
        root = self._engine_env.get(_snapshot_root.ENV_VAR)
        store_file = (
            os.path.join(root, f"{rank_side.STORE_FILE_PREFIX}{nonce.hex()[:16]}")
            if single_host and root
            else None
        )
        bind = master_addr
        store_timeout = min(self._pg_timeout, self._timeout)
        port = self.gather_ranks(
            {0: group.views[0]},
            lambda _, view: view.apply_async(
                rank_side.open_store, bind, n, store_timeout, store_file
            ),
            "opening the rendezvous store",
        )[0]

        env = {**(socket_env() if single_host else {}), **self._engine_env}
        specs = {
            slot.rank: rank_side.JoinSpec(
                rank=slot.rank,
                world_size=n,
                local_rank=slot.local_rank,
                local_world_size=slot.local_world_size,
                master_addr=master_addr,
                master_port=port,
                store_file=store_file,
                backend=placement.backend,
                device=placement.device_for(slot.local_rank),
                cuda_devices=placement.visible_for(slot.local_world_size),
                pg_timeout_s=self._pg_timeout,
                env=env,
                # Several hosts: each rank binds gloo/NCCL to the interface of its address.
                socket_address=None if single_host else slot.address,
                flight_recorder=self._flight_recorder,
                check_collectives=self._check_collectives,
                # Whose pool it is, and nothing secret: every user reads a process's title.
                title=f"fsdp-interactive rank {slot.rank}/{n}, kernel pid {os.getpid()}",
            )
            for slot in slots
        }
        agents = {
            slot.rank: _engine_shell.AgentSpec(
                host=self._agent_host(single_host, slot.address),
                nonce=nonce.hex(),
                end_with_owner=self._owned,
            )
            for slot in slots
        }
        joined = self.gather_ranks(
            group.views,
            lambda rank, view: view.apply_async(_engine_shell.join_pool, specs[rank], agents[rank]),
            "forming the process group",
        )
        group.records = [
            RankRecord(
                rank=slot.rank,
                local_rank=slot.local_rank,
                world_size=n,
                host=slot.host,
                pid=slot.pid,
                device=joined[slot.rank]["device"],
                backend=joined[slot.rank]["backend"],
                engine_id=slot.engine_id,
                address=slot.address,
                visible_devices=joined[slot.rank].get("visible_devices"),
            )
            for slot in slots
        ]
        group.thread_ids = {r: joined[r]["thread_id"] for r in joined}
        group.agents = {r: joined[r]["agent"] for r in joined}
        group.recorder_notes = {r: joined[r]["recorder_note"] for r in joined}
        for r in sorted(joined):
            log.debug("rank %d collective sockets: %s", r, joined[r].get("socket_ifnames") or {})
        return group

    def _agent_host(self, single_host: bool, address: str) -> str:
        """Where a rank's agent listens: the socket folder of a single-host group (else
        loopback), the rank's address across hosts."""
        if not single_host:
            return address
        return self._socket_folder or "127.0.0.1"

    def set_up_namespaces(self, group: Group) -> None:
        """Pre-fill every rank's namespace (see :data:`NAMESPACE_SETUP`)."""
        self.gather_ranks(
            group.views,
            lambda _, view: view.execute(NAMESPACE_SETUP, block=False, silent=False),
            "setting up the rank namespaces",
        )

    def gather_ranks(
        self, views: Mapping[int, Any], send: Callable[[int, Any], Any], what: str
    ) -> dict[int, Any]:
        """Results of one start-up step's call on ranks (``views``: rank -> its view;
        ``send(rank, view)`` sends the rank's request), by rank. When the pool has a log
        level the ranks' output is shown tagged by rank, each request watched from its
        first message (:func:`~._call_output.send_requests`)."""
        shown = self._log_level is not None
        return self.gather(send_requests(views, send, watched=shown), what, ranked=shown)

    def _exited_engines(self, wait_s: float = 0.0) -> list[EngineProcess]:
        """The launched engines that ended, waiting up to ``wait_s`` seconds for one to."""
        if self._launched is None:
            return []
        end = time.monotonic() + wait_s
        while not (exited := self._launched.exited_engines()) and time.monotonic() < end:
            time.sleep(_POLL_S)
        return exited

    def gather(
        self, handles: Mapping[int, Any], what: str, *, ranked: bool = False
    ) -> dict[int, Any]:
        """Results of one start-up step's calls, keyed as ``handles``.

        ``ranked``: the keys are ranks, and the ranks' output is shown tagged by rank.
        Raises :class:`PoolStartError` at the first failure, at the timeout, or when an
        engine process exits.
        """
        began = time.monotonic()
        deadline = began + self._timeout
        printer = TaggedPrinter() if ranked else None
        pump = OutputPump(handles, printer) if printer is not None else None
        try:
            while not all(h.ready() for h in handles.values()):
                if pump is not None:
                    pump()
                if any(h.ready() and not h.successful() for h in handles.values()):
                    break  # one failure is enough: peers may wait for it forever
                if time.monotonic() > deadline:
                    raise PoolStartError(f"timed out after {self._timeout:g}s while {what}")
                exited = self._exited_engines()
                if exited:
                    raise PoolStartError(_exited(exited[0], f"while {what}"))
                # Returns as soon as that call completes; the checks above run again
                # at least every _POLL_S.
                pending = next((h for h in handles.values() if not h.ready()), None)
                if pending is not None:
                    pending.wait(_POLL_S)
            if pump is not None:
                for handle in handles.values():
                    handle.wait_for_output(_POLL_S)
                pump()
        finally:
            if pump is not None:
                pump.close()
            if printer is not None:
                printer.flush()
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        engine_died = False
        for key, handle in handles.items():
            if not handle.ready():
                continue
            try:
                results[key] = handle.get(0)
            except Exception as exc:
                failures[key] = traceback_text(exc)
                engine_died = engine_died or _engine_death(exc)
        if failures:
            # ipyparallel's "Engine N died" says nothing of why: the process's end does.
            exited = self._exited_engines(_EXIT_NOTICE_S) if engine_died else []
            if exited:
                raise PoolStartError(_exited(exited[0], f"while {what}"))
            first = min(failures)
            raise PoolStartError(f"failed while {what} (rank/engine {first}):\n{failures[first]}")
        log.debug("%s took %.2fs", what, time.monotonic() - began)
        return results


def host_reports(
    slots: list[RankSlot], described: Mapping[int, Mapping[str, Any]]
) -> dict[str, tuple[int, int | None]]:
    """Per host (in rank order): ``(ranks on it, CUDA devices its engines see)``, the
    smallest count its engines reported (``None`` when they were not asked)."""
    hosts: dict[str, tuple[int, int | None]] = {}
    for slot in slots:
        count = described[slot.engine_id].get("cuda_devices")
        ranks, known = hosts.get(slot.host, (0, None))
        if count is not None:
            known = int(count) if known is None else min(known, int(count))
        hosts[slot.host] = (ranks + 1, known)
    return hosts


def refuse_other_versions(described: Mapping[int, Mapping[str, Any]]) -> None:
    """``PoolStartError`` naming both versions when an engine runs another torch,
    fsdp_interactive or Python minor version than this kernel (see :mod:`pool.common._hosts`)."""
    here = _hosts.versions()
    problems = []
    for engine_id, info in sorted(described.items()):
        there = info.get("versions")
        if not isinstance(there, Mapping):
            continue
        mismatches = _hosts.version_mismatches(here, there)
        if mismatches:
            where = f"engine {engine_id} on {info.get('host')} ({info.get('python')})"
            problems.append(_hosts.describe_mismatches(where, mismatches))
    if problems:
        raise PoolStartError(
            "ranks must run the versions this kernel runs:\n  "
            + "\n  ".join(problems)
            + "\ninstall the same versions there (or point the launcher at a Python that has "
            "them, e.g. SSHEngineSetLauncher.remote_python)"
        )


def connect_client(connect_kwargs: Mapping[str, Any]) -> Any:
    """An ``ipyparallel.Client`` of a running cluster (found as ``Client`` finds it)."""
    import ipyparallel as ipp

    kwargs = dict(connect_kwargs)
    # ipyparallel 9 accepts ``url_file=`` but ignores it: the file goes positionally.
    url_file = kwargs.pop("url_file", None)
    args = [url_file] if url_file is not None else []
    try:
        return ipp.Client(*args, **kwargs)
    except Exception as exc:
        raise PoolStartError(f"could not connect to the cluster: {exc}") from exc


def leave_group(client: Any, records: list[RankRecord]) -> None:
    """Make the ranks of a cluster the pool does not own leave the group (best effort)."""
    ids = [r.engine_id for r in records if r.engine_id in client.ids]
    client[ids].apply_async(rank_side.leave_group).wait(10)


def socket_env() -> dict[str, str]:
    """Keep gloo's and NCCL's listeners on loopback for a single-host pool (variables
    already set in this kernel's environment are left to the engines, which inherit them)."""
    loopback = _hosts.interface_holding("127.0.0.1")
    if loopback is None:
        return {}
    return {var: loopback for var in SOCKET_IFNAME_VARS if var not in os.environ}
