"""``Pool``: an ipyparallel cluster whose every engine is one ``torch.distributed`` rank.

What the notebook front relies on: ``start()`` forms a fresh default process group (gloo
on CPU, NCCL on CUDA) without the calling process initialising CUDA; ``run``, ``call``,
``push`` and ``pull`` reach the targeted ranks concurrently and number them by rank, never
by engine id; every outcome but success raises (:class:`RankError`, :class:`RankTimeout`
with every rank's stack, :class:`RankDied`, :class:`RankInterrupted`, :class:`PoolBusy`
while ranks still run an earlier call); ``stacks()``, ``trace()``, ``debug()`` and
``fsdp_interactive.breakpoint()`` reach local and remote ranks the same way; ``recover()``
brings the ranks back to a snapshot after a fault; ``stop()`` ends exactly the processes
the pool started, also at interpreter exit or (through a reaper) when the kernel dies.

One class, a facade: its calls (start, run, call, push, pull, the fault calls ``check``,
``recover``, ``snapshots`` and the debugging calls ``stacks``, ``trace``, ``debug``,
``interrupt``) are its methods, each handing the work to the part that holds it, in the
folder that says where it runs: :mod:`._placement` (ranks, devices, backend),
:mod:`._rendezvous` (forming the group), :mod:`._live_group` and :mod:`._dispatch` (a formed
group and its calls), :mod:`._journal`, :mod:`._snapshots`, :mod:`._faults` and
:mod:`._recovery` (what keeps the work through a fault), :mod:`._script_calls` and
:mod:`._export` (scripts in and out), ``processes/`` (starting, forking, watching and
ending engines, on this host and others), ``rank/`` (what runs inside every engine) and
``diagnostics/`` (stacks, timeouts, deaths, interrupts, the debugger). Its states are
:class:`~._pool_state.PoolState`.

Not done: restarting a single rank (a group cannot take a rank back; the whole group is
restarted or recovered).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsdp_interactive.checkpoint._format import _owner_key
from fsdp_interactive.pool import _cell_imports, _export, _recovery, _script_calls, _stray_comms
from fsdp_interactive.pool._call_output import send_requests
from fsdp_interactive.pool._dispatch import (
    PendingCall,
    Targets,
    check_timeout,
    resolve_targets,
)
from fsdp_interactive.pool._faults import PoolFaults
from fsdp_interactive.pool._journal import Journal
from fsdp_interactive.pool._live_group import LiveGroup
from fsdp_interactive.pool._options import check_options, flight_recorder_entries
from fsdp_interactive.pool._output import OutputSink, RunResult, run_result
from fsdp_interactive.pool._placement import check_request, oversubscription, plan
from fsdp_interactive.pool._pool_state import PoolHealth, PoolState
from fsdp_interactive.pool._recovery import RecoveryPlan
from fsdp_interactive.pool._recovery_report import RecoveryReport, RecoveryWatchers
from fsdp_interactive.pool._rendezvous import Rendezvous, connect_client
from fsdp_interactive.pool._snapshots import SnapshotBook, SnapshotInfo
from fsdp_interactive.pool._start_progress import StartProgress, describe_ranks
from fsdp_interactive.pool.common import _hosts, _logs, _snapshot_root
from fsdp_interactive.pool.common._collectives import CollectiveTrace
from fsdp_interactive.pool.common._topology import RankRecord, format_table
from fsdp_interactive.pool.diagnostics._hang_watch import DEFAULT_AFTER_S as DEFAULT_HANG_NOTICE_S
from fsdp_interactive.pool.diagnostics._hang_watch import threshold as hang_threshold
from fsdp_interactive.pool.diagnostics._interrupt import InterruptReport
from fsdp_interactive.pool.diagnostics._post_mortem import DebuggerOutput, debug_command
from fsdp_interactive.pool.errors import (
    RECOVER,
    RESTART,
    START,
    PoolNotRunning,
)
from fsdp_interactive.pool.processes._channels import INSECURE_NOTE, check_connected_channels
from fsdp_interactive.pool.processes._launched import BROKEN_STOP_TIMEOUT_S, LaunchedProcesses
from fsdp_interactive.pool.rank import _engine_shell, _results, _snapshot_functions

log = logging.getLogger(__name__)

# Running pools are held here until stopped, so one is never garbage-collected while
# its processes run; at interpreter exit every pool still here is stopped.
_live_pools: set[Pool] = set()


def _stop_live_pools() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.stop()


atexit.register(_stop_live_pools)


def _checkpoint_key_env() -> dict[str, str]:
    """This user's checkpoint key for every rank (``FSDPI_CHECKPOINT_KEY``), so that ranks
    on hosts without this user's home seal and check disk checkpoints with it too; nothing
    when it cannot be had here (a save then says why on the ranks)."""
    try:
        return {_owner_key.KEY_ENV: _owner_key.key_hex()}
    except _owner_key.OwnerKeyError as error:
        log.debug("no checkpoint key for the ranks: %s", error)
        return {}


class Pool:
    """A pool of ``n`` engines, each one ``torch.distributed`` rank.

    Parameters
    ----------
    n:
        Number of ranks (>= 1). Default: the number of visible CUDA devices (or of
        ``devices``), else 2 CPU ranks (``Pool.connect``: every registered engine).
    devices:
        CUDA device indices, one per local rank (any subset, e.g. ``[1, 3]``; indices as
        the engines see them under the current ``CUDA_VISIBLE_DEVICES``), or ``"cpu"``
        for CPU ranks. A rank sees its host's chosen devices in local-rank order and runs
        on ``cuda:<local_rank>``, as under torchrun. Default: CUDA devices ``0..n-1``
        when CUDA is visible, else CPU; engines elsewhere: from what they report.
    backend:
        ``"nccl"`` or ``"gloo"``; default ``nccl`` on CUDA, ``gloo`` on CPU.
        ``backend="gloo"`` without ``devices`` gives CPU ranks.
    engines:
        ipyparallel engine launcher (``"local"``, ``"ssh"``, ``"slurm"``, ``"mpi"``, ...).
        Other keyword arguments go to ``ipyparallel.Cluster`` unchanged (e.g.
        ``profile_dir``, ``controller_ip``, ``config``).
    timeout:
        Seconds for start-up: engines registering plus process-group creation. An
        engine lost on the way (it exits, or stays silent while the others register) is
        started once more, and that may add up to half of ``timeout``.
    pg_timeout:
        ``torch.distributed`` process-group timeout in seconds (default 600): a
        collective waiting longer than this fails on the ranks. The pool's own watchdog
        (``timeout=`` of ``run``/``call``) reports hangs sooner, without killing anything.
    show_topology:
        Print the rank table when the pool starts.
    show_progress:
        Show the start's phases while it runs (controller up, engines k/N registered,
        group formed), on one line that moves in place on stdout.
    oversubscribe:
        Start more CPU ranks than this host has cores without the warning that says so
        (also ``$FSDPI_OVERSUBSCRIBE=1``).
    interrupt_grace:
        Seconds to wait for ranks to stop after forwarding SIGINT.
    log_level:
        Show the package's log records at this level (``"debug"``, ``"info"``, ... or a
        :mod:`logging` number) from ``start()`` on: start-up phases with their
        durations, process ownership, teardown, deaths and interrupts in this process,
        and the ranks' own ``fsdp_interactive.*`` records, tagged by rank. Default:
        ``$FSDPI_LOG_LEVEL`` if set, else nothing is shown.
    flight_recorder:
        Entries of torch's flight recorder per rank (``TORCH_FR_BUFFER_SIZE``), which
        ``trace()`` and timeouts read; 0 turns it off. Default: the environment's
        ``TORCH_FR_BUFFER_SIZE`` if set, else 64.
    check_collectives:
        Run the ranks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch checks before every
        collective that all ranks call the same one with matching shapes, and a mismatch
        becomes an error naming both (at the cost of an extra check per collective).
    recover:
        ``"auto"``: when a rank dies, or a ``timeout`` finds ranks blocked in a collective,
        :meth:`recover` runs by itself and the call's error ends with what it restored.
        Default ``None``: the error says to call ``recover()`` or ``restart()``.
    hang_notice:
        Seconds (default 30) after which a running call shows a live notice when some
        ranks wait in a collective (or a barrier) that other ranks never reach: which
        ranks, the collective, the line, and what to type. ``False`` turns it off; the
        attribute of the same name changes it later, ``run(hang_notice=...)`` for one
        call. The notice never ends a call (``timeout=`` does).
    insecure_network:
        Start even where the pool cannot keep its channels from other users (engines on
        other hosts without CurveZMQ, a controller launcher a config chose, a connected
        cluster on plain TCP), leaving every cell's source and output readable on the
        network; the start says so. Default ``False``: such a pool refuses to start
        (docs/security.md). A one-host pool listens only in its private socket folder,
        a pool across hosts encrypts with CurveZMQ, whatever this says.
    """

    def __init__(
        self,
        n: int | None = None,
        devices: Sequence[int] | str | None = None,
        backend: str | None = None,
        engines: str = "local",
        timeout: float = 120.0,
        *,
        pg_timeout: float = 600.0,
        show_topology: bool = True,
        interrupt_grace: float = 10.0,
        log_level: int | str | None = None,
        flight_recorder: int | None = None,
        check_collectives: bool = False,
        recover: str | None = None,
        hang_notice: float | bool = DEFAULT_HANG_NOTICE_S,
        insecure_network: bool = False,
        show_progress: bool = True,
        oversubscribe: bool = False,
        **cluster_kwargs: Any,
    ) -> None:
        self._request = check_request(n, devices, backend)
        if not isinstance(insecure_network, bool):
            raise ValueError(f"insecure_network must be True or False, got {insecure_network!r}")
        self.insecure_network = insecure_network
        check_options(
            engines=engines,
            timeout=timeout,
            pg_timeout=pg_timeout,
            flight_recorder=flight_recorder,
            check_collectives=check_collectives,
            recover=recover,
            oversubscribe=oversubscribe,
            show_progress=show_progress,
        )
        _hosts.check_controller_ip(cluster_kwargs.get("controller_ip"))
        self._log_level = _logs.parse_level(log_level)
        if self._log_level is None:
            self._log_level = _logs.level_from_env()
        self.engines = engines
        self.timeout = float(timeout)
        self.pg_timeout = float(pg_timeout)
        self.show_topology = show_topology
        self.show_progress = show_progress
        self.oversubscribe = oversubscribe
        self.interrupt_grace = float(interrupt_grace)
        self.flight_recorder = flight_recorder
        self.check_collectives = check_collectives
        self.recover_mode = recover
        hang_threshold(hang_notice)
        #: Seconds before a running call's hang notice (``False``: no notice).
        self.hang_notice: float | bool = hang_notice
        #: Every ``run`` on the ranks, for recovery to replay (see :mod:`._journal`).
        self.journal = Journal()
        self._snapshot_book = SnapshotBook()
        self._cluster_kwargs = dict(cluster_kwargs)
        self._connect_kwargs: dict[str, Any] | None = None

        self._state = PoolState.STOPPED
        self._snapshot_root = _snapshot_root.new_root()
        # Authenticates every snapshot this pool writes (kept across restarts, for recover).
        self._snapshot_key = _snapshot_root.new_key()
        self._processes = LaunchedProcesses(
            log_level=self._log_level,
            snapshot_root=self._snapshot_root,
            insecure_network=insecure_network,
        )
        self._client: Any = None
        self._live: LiveGroup | None = None
        self._faults = PoolFaults(self)
        self._recovery_watchers = RecoveryWatchers()
        #: True after an interrupt landed inside a collective (torch.distributed, or NCCL work
        #: left unfinished on a GPU); restart() clears it.
        self.needs_restart = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def connect(
        cls,
        connection_file: str | None = None,
        *,
        profile: str | None = None,
        profile_dir: str | None = None,
        cluster_id: str | None = None,
        n: int | None = None,
        devices: Sequence[int] | str | None = None,
        backend: str | None = None,
        timeout: float = 120.0,
        **kwargs: Any,
    ) -> Pool:
        """A pool over the engines of an already running ipyparallel cluster.

        The cluster is found as ``ipyparallel.Client`` finds it (a client connection
        file, or profile / profile_dir / cluster_id). ``n`` defaults to the engines
        registered when the pool starts (at least one is waited for). The pool does not
        own these engines: ``stop()`` leaves the process group and disconnects, but does
        not end the engines; ``restart()`` re-creates the group on the same engines.
        """
        pool = cls(n=n, devices=devices, backend=backend, timeout=timeout, **kwargs)
        if pool._cluster_kwargs:
            raise TypeError(
                "Pool.connect() got options for starting a cluster, which it does not do: "
                + ", ".join(sorted(pool._cluster_kwargs))
            )
        pool._connect_kwargs = {
            key: value
            for key, value in (
                ("url_file", connection_file),
                ("profile", profile),
                ("profile_dir", profile_dir),
                ("cluster_id", cluster_id),
            )
            if value is not None
        }
        return pool

    @property
    def owns_engines(self) -> bool:
        """True when this pool started its engines (and so may stop or restart them)."""
        return self._connect_kwargs is None

    @property
    def running(self) -> bool:
        return self._state is PoolState.RUNNING

    @property
    def state(self) -> PoolState:
        """A :class:`PoolState` (a ``str``): ``"stopped"``, ``"starting"``, ``"running"`` or
        ``"broken"`` (a rank died; call ``restart()``)."""
        return self._state

    @property
    def launched_pids(self) -> dict[int, float]:
        """Every pid this pool started (controller, engines, their nannies), across
        restarts, with its start time."""
        return self._processes.pids

    @property
    def snapshot_root(self) -> str:
        """This pool's snapshot root (``$FSDPI_SNAPSHOT_ROOT`` of every rank, the same path
        on every host); its engine forkers remove it when it stops, not when a rank dies."""
        return self._snapshot_root

    @property
    def topology(self) -> list[RankRecord]:
        """One record per rank, in rank order (empty when not running)."""
        return list(self._live.records) if self.running and self._live else []

    @property
    def world_size(self) -> int:
        return len(self.topology)

    def topology_table(self) -> str:
        """The topology as a text table."""
        return format_table(self.topology)

    def __repr__(self) -> str:
        return f"<Pool {self._state} world_size={self.world_size} engines={self.engines!r}>"

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Pool:
        """Start engines (or connect), form the process group, show the topology; return self.

        Raises :class:`PoolStartError` (after stopping everything it started) when the
        engines do not register or the group does not form within ``timeout``, and
        ``ValueError`` for devices that are not present or fewer devices than ranks.
        """
        self._faults.finish_cleanup()
        if self.running:
            return self
        if self._state is PoolState.BROKEN:
            self._teardown(keep_forker=True)
        if self._log_level is not None:
            _logs.enable(self._log_level)
        local = self.owns_engines and self.engines == "local"  # else engines report devices
        placement = plan(self._request, local_engines=local, connecting=not self.owns_engines)
        crowded = oversubscription(placement, local_engines=local, allowed=self.oversubscribe)
        if crowded:
            print(f"fsdp-interactive: warning: {crowded}", file=sys.stderr, flush=True)
        log.debug("starting: %s, engines=%r", placement, self.engines)
        progress = StartProgress(
            describe_ranks(placement.n, placement.devices, placement.backend),
            shown=self.show_progress,
            moving=self._log_level is None,  # log records come between the phases
        )
        progress.controller_starting(connecting=not self.owns_engines)
        began = time.monotonic()
        self._state = PoolState.STARTING
        _live_pools.add(self)
        try:
            rendezvous = self._open(placement.n, progress)
            n = placement.n or len(self._client.ids)
            progress.engines_up(n)
            group = rendezvous.form_group(n, placement)
            for record in group.records:
                self._processes.alias(record.pid, group.parent_pids.get(record.rank))
            self._live = LiveGroup(self._client, group, self._processes, owned=self.owns_engines)
            rendezvous.set_up_namespaces(group)
        except BaseException:
            progress.failed()
            log.debug(
                "start-up failed after %.2fs; stopping what was started", time.monotonic() - began
            )
            self._teardown()
            raise
        progress.formed()
        self._state = PoolState.RUNNING
        self._faults.started()
        self.needs_restart = False
        self.journal.new_epoch()
        log.debug("running: %d ranks, started in %.2fs", n, time.monotonic() - began)
        if self.show_topology:
            print(self.topology_table(), flush=True)
        return self

    def _open(self, n: int | None, progress: StartProgress) -> Rendezvous:
        """Launch the cluster (or connect to it) and wait for its engines to register."""
        deadline = time.monotonic() + self.timeout
        reconnect: Callable[[float], Any]
        if self.owns_engines:
            assert n is not None
            self._client = self._processes.launch(
                n,
                engines=self.engines,
                cluster_kwargs=self._cluster_kwargs,
                timeout=self.timeout,
                on_controller_up=progress.controller_up,
            )
            reconnect = self._processes.connect_client
            channels = self._processes.channels
            insecure = channels is not None and channels.insecure
        else:
            assert self._connect_kwargs is not None
            connect_kwargs = self._connect_kwargs
            self._client = connect_client(connect_kwargs)
            progress.controller_up(connecting=True)
            reconnect = lambda timeout: connect_client({**connect_kwargs, "timeout": timeout})  # noqa: E731
            insecure = check_connected_channels(
                self._client, insecure_network=self.insecure_network
            )
        if insecure:
            progress.notice(f"fsdp-interactive: {INSECURE_NOTE}", stream="stderr")
        rendezvous = Rendezvous(
            self._client,
            timeout=self.timeout,
            pg_timeout=self.pg_timeout,
            launched=self._processes if self.owns_engines else None,
            log_level=self._log_level,
            flight_recorder=flight_recorder_entries(self.flight_recorder),
            check_collectives=self.check_collectives,
            engine_env={
                _snapshot_root.ENV_VAR: self._snapshot_root,
                _snapshot_root.KEY_ENV_VAR: self._snapshot_key,
                **_checkpoint_key_env(),
            },
            socket_folder=self._processes.socket_folder if self.owns_engines else None,
        )
        try:
            rendezvous.wait_for_engines(
                n or 1,
                deadline,
                reconnect=reconnect,
                on_count=lambda count: progress.registered(count, n),
                notice=progress.notice,
            )
        finally:
            self._client = rendezvous.client  # a new client may have taken over
        _stray_comms.keep_iopub_alive(self._client)
        return rendezvous

    def stop(self) -> None:
        """End the group and the processes this pool started; idempotent.

        Owned clusters are stopped through ipyparallel's launcher handles (SIGTERM, then
        SIGKILL after a grace period); any recorded pid still alive afterwards is killed by
        that exact pid. The snapshots in host memory are freed: by the live ranks on every
        host, by every host's engine forker as it ends (it removes :attr:`snapshot_root`
        there) and here on this host. A connected (not owned) cluster is only left and
        disconnected.
        """
        self._faults.finish_cleanup()
        if self.running:
            try:
                self.call(_snapshot_functions.drop_here, timeout=30)
            except Exception as error:  # the forkers and the lines below still free them
                log.debug("the ranks could not free their hosts' snapshots: %s", error)
        self._faults.finish_cleanup()  # a rank found dead just now: its teardown first
        self._teardown()
        _snapshot_root.remove_root(self._snapshot_root)
        self._snapshot_book.clear()

    def restart(self) -> Pool:
        """A fresh process group without restarting the notebook kernel.

        Owned engines are stopped and started again (all rank state is lost);
        connected engines leave the old group and form a new one.
        """
        self._faults.finish_cleanup()
        self._teardown(keep_forker=True)
        return self.start()

    def _teardown(
        self, keep_forker: bool = False, final_state: PoolState = PoolState.STOPPED
    ) -> None:
        """Stop what this pool started (owned) or leave the group (connected).

        ``keep_forker``: leave the engine forkers (and the snapshot root) in place, for a
        restart or a recovery to fork from; ``final_state``: the state afterwards.
        """
        if self._state is not PoolState.STOPPED:
            log.debug("tearing down (state %s)", self._state)
        if self._live is not None:
            self._faults.take_notices()
            self._live.close()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        self._processes.stop(
            keep_forker=keep_forker,
            engines_timeout=BROKEN_STOP_TIMEOUT_S if final_state is PoolState.BROKEN else None,
        )
        self._client = self._live = None
        self._state = final_state
        if final_state is PoolState.STOPPED:
            _live_pools.discard(self)

    # ------------------------------------------------------------------ work

    def run(
        self,
        code: str,
        targets: Targets = None,
        timeout: float | None = None,
        stream: bool = True,
        *,
        on_output: OutputSink | None = None,
        cell: int | None = None,
        native: bool = False,
        replay: bool | None = None,
        journal: bool = True,
        replaying: bool = False,
        replayed: int | None = None,
        journal_text: str | None = None,
        hang_notice: float | bool | None = None,
        on_interrupt: Callable[[list[int]], None] | None = None,
    ) -> RunResult:
        """Execute ``code`` on the targeted ranks concurrently; return their output.

        The code runs in each engine's persistent namespace, which the pool pre-fills
        with ``torch``, ``dist`` (``torch.distributed``), ``rank``, ``world_size``,
        ``local_rank`` and ``device``. With ``stream=True`` output is printed while the
        ranks run, each line tagged ``[rank N]`` (or handed to ``on_output(rank, stream,
        text)`` when given). ``timeout`` (seconds, default none) arms the hang watchdog;
        with ``native=True`` its report adds py-spy's native frames. A cell that runs
        collectives must target every rank, or it will hang.

        ``cell``: the notebook's execution count of the cell this code comes from; the
        ranks then name the code ``Cell In[cell]`` in tracebacks, stacks and the
        debugger, and keep an exception it raises for :meth:`debug`.

        Every run is an entry of :attr:`journal`; :meth:`recover` replays it when its slice
        needs it (:mod:`._slice`), ``replay=True`` always (``%%fsdp --replay``),
        ``replay=False`` never (``--no-replay``). ``journal=False`` leaves it out (calls the
        package makes for itself), ``journal_text`` is what the journal shows instead of
        ``code`` (the magic line that generated it); ``replaying`` marks a recovery's own
        replay (no snapshot is taken), ``replayed`` the entry it replays (its generators are
        set around it). A rank that died since the last call raises :class:`RankDied` here,
        and ``code`` does not run. ``hang_notice``: this run's threshold for the live hang
        notice (seconds, or ``False``: none); ``None`` keeps the pool's.
        ``on_interrupt(ranks)``: what the first Ctrl-C while waiting does instead of
        interrupting (see :class:`~._dispatch.PendingCall`).
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a string of Python source, got {type(code).__name__}")
        if cell is not None and (isinstance(cell, bool) or not isinstance(cell, int) or cell < 0):
            raise ValueError(f"cell must be the notebook's execution count (an int), got {cell!r}")
        if replay not in (None, True, False):
            raise ValueError(f"replay must be None (the slice decides), True or False: {replay!r}")
        after = hang_threshold(self.hang_notice if hang_notice is None else hang_notice)
        views = self._begin(targets, timeout)
        entry = (
            self.journal.begin(
                code,
                cell=cell,
                targets=None if targets in (None, "all") else list(views),
                replay=replay,
                shown=journal_text,
            )
            if journal
            else None
        )
        started = time.monotonic()
        # The call and cell numbers travel in the code's own request: one message per rank.
        call = entry.id if entry is not None else None
        sent = _engine_shell.mark_call(
            code, call, cell, replaying=replaying, replayed=replayed, kept_out=replay is False
        )
        # Streamed: every message watched from the first, none lost to a late subscription.
        handles = send_requests(
            views, lambda _, view: view.execute(sent, block=False, silent=False), watched=stream
        )
        pending = self._pending(
            handles,
            stream=stream,
            on_output=on_output,
            code=code,
            cell=f"Cell In[{cell}]" if cell is not None else None,
            native=native,
            finish=lambda _: run_result(handles, time.monotonic() - started),
            hang_after=after,
            on_interrupt=on_interrupt,
        )
        with self._faults.outcome(entry):
            result = pending.wait(timeout)
        if entry is not None and entry.replayable and _cell_imports.enabled():
            # What a recovery will replay, its new engines then find imported already.
            self._processes.forkers.warm(_cell_imports.import_specs(code))
        return result

    def run_script(
        self,
        path: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        targets: Targets = None,
        stop_at: int | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        stream: bool = True,
        on_output: OutputSink | None = None,
        cell: int | None = None,
        journal_text: str | None = None,
    ) -> _script_calls.ScriptStatus:
        """Run the torchrun script ``path`` with ``args`` on the targeted ranks, unmodified,
        and keep what it built; return where it stands (:class:`ScriptStatus`).

        Each rank runs it as ``__main__`` with what torchrun gives a script (``RANK``,
        ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_RUN_ID``,
        ``OMP_NUM_THREADS`` ..., ``sys.argv``, its folder on ``sys.path``, ``cwd``: default
        the kernel's working directory); its ``init_process_group`` adopts the pool's group,
        its ``destroy_process_group`` leaves it alive (:mod:`.rank._torchrun_world`).
        ``stop_at=N`` pauses every rank after its N-th optimizer step with the script's
        frames alive: its module globals and its frames' locals are then names of the
        ranks' namespace, for cells, views, snapshots and checkpoints, until
        :meth:`continue_script`. When it returns, raises or is stopped, what it built stays
        the same way. The first Ctrl-C pauses it after the next optimizer step; the second
        interrupts it. A script that raises raises :class:`RankError` with its traceback
        (``error.script_status`` says what it kept). Journaled like a cell
        (:mod:`._script_record`; ``journal_text``: what the journal shows for it, as for
        :meth:`run`); one run at a time.
        """
        return _script_calls.run_script(
            self,
            path,
            args,
            targets=targets,
            stop_at=stop_at,
            cwd=cwd,
            timeout=timeout,
            stream=stream,
            on_output=on_output,
            cell=cell,
            shown=journal_text,
        )

    def continue_script(
        self,
        stop_at: int | None = None,
        *,
        stop: bool = False,
        timeout: float | None = None,
        stream: bool = True,
        on_output: OutputSink | None = None,
        cell: int | None = None,
        journal_text: str | None = None,
    ) -> _script_calls.ScriptStatus:
        """Resume the paused script run, to pause again after its ``stop_at``-th optimizer
        step (counted from the run's start; ``None``: run to the end or to an interrupt);
        ``stop=True`` ends it at its pause instead (its ``finally`` blocks run)."""
        return _script_calls.continue_script(
            self,
            stop_at,
            stop=stop,
            timeout=timeout,
            stream=stream,
            on_output=on_output,
            cell=cell,
            shown=journal_text,
        )

    def export(
        self,
        path: str | os.PathLike[str],
        *,
        sbatch: bool = False,
        nodes: int | None = None,
        gpus_per_node: int | None = None,
        from_snapshot: str | None = None,
        from_checkpoint: str | os.PathLike[str] | None = None,
        train: Sequence[int] = (),
        dry_run: bool = False,
    ) -> _export.ExportPlan:
        """Write the calls that built the ranks' state as a standalone torchrun script at
        ``path`` (with its values file beside it, and with ``sbatch`` an sbatch file) that,
        run on this pool's world size, builds the same parameters and optimizer state bit
        for bit; return the :class:`ExportPlan` (``dry_run``: only the plan).
        ``from_snapshot`` / ``from_checkpoint``: the script loads that state instead of
        training up to it, then runs the training cells (``train``: their cell numbers;
        default: the calls after the snapshot). ``nodes``, ``gpus_per_node``: the job's
        layout (default: the pool's). What cannot be carried is listed with its reason and
        nothing is written (:class:`ExportRefused`). See :mod:`._export`."""
        return _export.export(
            self,
            path,
            sbatch=sbatch,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            from_snapshot=from_snapshot,
            from_checkpoint=from_checkpoint,
            train=train,
            dry_run=dry_run,
        )

    def script_status(self) -> _script_calls.ScriptStatus | None:
        """Where the current (or last) script run stands on the ranks; ``None``: none ran."""
        return _script_calls.script_status(self)

    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        targets: Targets = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on the targeted ranks concurrently; results in rank order.

        ``fn`` is serialised by ipyparallel (module-level functions by reference,
        notebook-defined ones by value, running in the engine namespace). ``targets``
        and ``timeout`` are the pool's and cannot be passed through to ``fn``. Output
        printed by ``fn`` is streamed tagged by rank. Every tensor in a result comes
        back on the CPU (a DTensor: the rank's shard; :mod:`pool.rank._results`).
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        return self._call(fn, args, kwargs, targets=targets, timeout=timeout, stream=True)

    def _call(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        targets: Targets = None,
        timeout: float | None = None,
        stream: bool,
    ) -> list[Any]:
        """:meth:`call`; ``stream=False`` collects the ranks' output instead of showing
        it (what the pool's own calls do, such as a recovery's restore)."""
        views = self._begin(targets, timeout)
        handles = send_requests(  # watched from the first message
            views, lambda _, view: view.apply_async(_results.call, fn, *args, **kwargs)
        )
        with self._faults.outcome(None):
            return self._pending(handles, stream=stream).wait(timeout)

    def push(self, mapping: Mapping[str, Any], targets: Targets = None) -> None:
        """Assign each ``name: value`` of ``mapping`` in the targeted ranks' namespaces."""
        if not isinstance(mapping, Mapping) or not all(isinstance(k, str) for k in mapping):
            raise TypeError("mapping must be a mapping of variable names (str) to values")
        views = self._begin(targets, None)
        handles = {r: view.push(dict(mapping), block=False) for r, view in views.items()}
        with self._faults.outcome(None):
            self._pending(handles).wait()
        self.journal.note_push(mapping, None if targets in (None, "all") else list(views))

    def pull(self, name: str, targets: Targets = None) -> list[Any]:
        """The value of ``name`` in each targeted rank's namespace, in rank order, with every
        tensor on the CPU as :meth:`call` returns results."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be a variable name, got {name!r}")
        views = self._begin(targets, None)
        handles = {r: view.apply_async(_engine_shell.pull, name) for r, view in views.items()}
        with self._faults.outcome(None):
            return self._pending(handles).wait()

    # ------------------------------------------------------------------ faults

    def check(self) -> PoolHealth:
        """Whether every rank still runs. Ranks that died since the last call (and engine
        forkers that ended) are noticed here, as before every call: a group that lost a
        rank is torn down, and the next call raises its :class:`RankDied` instead of
        running. Returns the :class:`PoolHealth` found (``death``: that error)."""
        return self._faults.notice()

    def recover(
        self,
        from_: str | os.PathLike | None = None,
        *,
        world: int | None = None,
        dry_run: bool = False,
        say: Callable[[str], None] | None = None,
    ) -> RecoveryReport | RecoveryPlan:
        """Bring the ranks back to a snapshot: after ``RankDied``, a wedged collective, a
        lost host, or at any time.

        Ends what is left of the group, starts a fresh one (on the hosts that remain; on
        ``world`` ranks when given, resharding), replays the journal's calls that rebuild the
        objects the snapshot restores into (the slice, :mod:`._slice`; the plan says each
        call's part and why), and loads the snapshot into them (model, optimizer, RNG,
        stateful objects). ``from_``: a snapshot id (default: the newest) or a checkpoint
        folder. ``dry_run``: only return (and print) the plan, after the same checks.
        Prints its progress (``say``: hands each line to it instead) and returns a
        :class:`RecoveryReport` (the snapshot's step and age, the calls replayed, each
        phase's seconds). Raises :class:`RecoveryError` with the pool as it was for
        what the checks refuse before anything ends (nothing to recover to, a folder that
        is not a snapshot, a damaged record, one that does not fit the live objects: see
        :mod:`._recovery_checks`); when a replayed call fails, the pool then runs a fresh,
        empty group. See :mod:`._recovery`.
        """
        return _recovery.recover(self, from_, world, dry_run=dry_run, say=say)

    def when_recovered(self, callback: Callable[[RecoveryReport], None]) -> None:
        """Call ``callback(report)`` after every recovery that succeeds (by
        :meth:`recover`, or by itself with ``recover="auto"``): what a view of the ranks
        refreshes on. A bound method is held weakly (a view that is gone is not called);
        a callback that raises is logged and does not fail the recovery."""
        self._recovery_watchers.add(callback)

    def snapshots(self) -> list[SnapshotInfo]:
        """The snapshots the kernel heard of, oldest first (see :mod:`._snapshots`)."""
        self._faults.take_notices()
        return self._snapshot_book.all()

    # ------------------------------------------------------------------ debugging

    def interrupt(self, targets: Targets = None) -> InterruptReport:
        """Send SIGINT to the targeted ranks (through ipyparallel's nanny); say what it did.

        When ranks still run a call that timed out or was interrupted, waits up to
        ``interrupt_grace`` seconds for those calls to end and reports per rank whether
        it stopped; a rank blocked inside a collective cannot be freed by SIGINT (the
        signal is handled only when the C++ call returns): it is reported as blocked
        and the pool then needs ``restart()``. Called while another thread waits on a
        call, it only signals (that call reports the outcome).
        """
        live = self._running()
        report = live.interrupt(resolve_targets(targets, self.world_size), self.interrupt_grace)
        if report.needs_restart:
            self.needs_restart = True
        return dataclasses.replace(report, snapshot_taken=bool(self.snapshots()))

    def busy_ranks(self) -> list[int]:
        """Ranks still running a call that timed out or was interrupted."""
        try:
            return self._running().unfinished.busy_ranks()
        except PoolNotRunning:
            return []

    def stacks(
        self, code: str | None = None, *, native: bool = False
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Every rank's current Python stack, without stopping any rank.

        Returns ``(stacks, where)``: ``stacks[rank]`` in traceback order with each
        frame's source line, and ``where[rank]`` a one-line summary. ``native=True``
        appends py-spy's native (C/C++) frames of each rank's user thread, run on the
        rank's host (needs py-spy there and ptrace permission; see
        :func:`pool.rank._thread_stacks.native_stack`). Ranks answer through their diagnostics
        agents; a rank whose agent cannot answer is asked by signal instead.
        """
        return self._running().stacks(code, native=native)

    def trace(
        self, last: int = 20, targets: Targets = None, *, issued_at: bool = False
    ) -> CollectiveTrace:
        """Every rank's recent collectives (torch's flight recorder) and where they disagree.

        ``str()`` of the result is the findings ("rank 0 waits in barrier #12; rank 1
        never issued #12 ...") and a table of the last ``last`` collectives per process
        group, merged across ranks that agree. Works while ranks are busy or blocked.
        ``issued_at=True`` adds the line that issued each collective; the first such call
        makes torch load its stack symbolizer on every rank (about 1.4 s and 70 MB each).
        """
        live = self._running()
        if isinstance(last, bool) or not isinstance(last, int) or last < 1:
            raise ValueError(f"last must be a number of collectives >= 1, got {last!r}")
        return live.trace(resolve_targets(targets, self.world_size), last, issued_at=issued_at)

    def debug(self, rank: int, command: str | None = None) -> DebuggerOutput:
        """Run one pdb ``command`` on the last exception a notebook cell raised on ``rank``.

        The session lives on between calls (``up`` stays up) until ``q``; without a
        command it starts (or shows where it stands). Returns pdb's output. Cells count
        when run with ``run(..., cell=N)`` (as ``%%fsdp`` does). Raises ``PoolError`` when
        the rank has no failure to look at.
        """
        live = self._running()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank!r}")
        if command is not None and not isinstance(command, str):
            raise TypeError(f"command must be a pdb command (str) or None, got {command!r}")
        return debug_command(live.diagnosis.agents, rank, command, hold_s=self.pg_timeout)

    # ------------------------------------------------------------------ calls' plumbing

    def _running(self) -> LiveGroup:
        """The live group, or :class:`PoolNotRunning` saying what to do."""
        if self._state is PoolState.BROKEN:
            death = self._faults.death
            what = death.summary if death is not None else "a rank died"
            raise PoolNotRunning(f"{what}, and the group was torn down", RECOVER, RESTART)
        if self._state is not PoolState.RUNNING or self._live is None:
            raise PoolNotRunning("the pool is not running", START)
        return self._live

    def _begin(self, targets: Targets, timeout: float | None) -> dict[int, Any]:
        """The views of the targeted ranks, once the pool can take a call (a rank that
        died since the last call raises here, recovered from with ``recover="auto"``)."""
        with self._faults.outcome(None):
            self._faults.before_call()
            live = self._running()
            check_timeout(timeout)
            return live.views(resolve_targets(targets, self.world_size))

    def _pending(self, handles: dict[int, Any], **options: Any) -> PendingCall:
        assert self._live is not None
        options.setdefault("hang_after", hang_threshold(self.hang_notice))
        return self._live.pending(
            handles,
            fail_dead=self._faults.fail_dead,
            needs_restart=self._faults.mark_needs_restart,
            interrupt_grace=self.interrupt_grace,
            **options,
        )
