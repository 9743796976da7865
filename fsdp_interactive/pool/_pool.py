"""``Pool``: an ipyparallel cluster whose every engine is one ``torch.distributed`` rank.

Contract (what the notebook front relies on):

* ``Pool(...).start()`` starts (or connects to) the engines, makes each one rank of a
  fresh default process group (gloo on CPU, NCCL on CUDA) and prints a topology table.
  The calling process never initialises CUDA.
* ``run(code)``, ``call(fn, ...)``, ``push(mapping)``, ``pull(name)`` send work to the
  targeted ranks *concurrently* and block until every targeted rank is done. Ranks are
  always numbered by ``torch.distributed`` rank, never by engine id; per-rank lists are
  in rank order of the targets.
* Outcomes other than success raise: :class:`RankError` (a rank raised),
  :class:`RankTimeout` (watchdog; ranks keep running and their stacks are attached),
  :class:`RankDied` (a rank process exited; the group is torn down, ``restart()``),
  :class:`RankInterrupted` (Ctrl-C / kernel interrupt during a blocking call; SIGINT was
  forwarded to the ranks through ipyparallel's nanny).
* While ranks still run a call that timed out or was interrupted, new calls raise
  :class:`PoolBusy` instead of queueing silently behind it.
* Debugging: ``stacks()`` (every rank's stack with source lines, optionally native
  frames), ``trace()`` (every rank's recent collectives from torch's flight recorder,
  on by default with a small buffer, and where the ranks disagree), ``debug(rank,
  command)`` (pdb on the last exception a notebook cell raised on that rank), and
  ``fsdp_interactive.breakpoint(rank=R)`` in a cell (the waiting call asks for the
  debugger's commands). All of it travels over the ranks' diagnostics agents
  (:mod:`._rank_agent`), the same way for local and remote ranks.
* ``stop()`` ends exactly the processes the pool started (through ipyparallel's launcher
  handles, then by recorded pid and start time if any survive); it also runs at
  interpreter exit, and an orphan reaper does it if the calling process is killed.

The pool is a facade over its parts: :mod:`._placement` (ranks, devices, backend),
:mod:`._processes` (the processes it starts and ends), :mod:`._rendezvous` (forming the
group), :mod:`._dispatch` (waiting for calls) and :mod:`._diagnosis` (stacks, timeouts,
deaths, interrupts). Its states are :class:`~._state.PoolState`. Log records of every
part are shown with ``log_level=`` (or ``$FSDPI_LOG_LEVEL``), see :mod:`._logs`.

Multi-node: any ipyparallel engine launcher can be named with ``engines=`` (its options
pass through, ``controller_ip`` included: the controller listens on loopback by default
and must be given an address of this host), or ``Pool.connect()`` joins a running
cluster. Remote engines run under :mod:`fsdp_interactive._engine_parent`, which reports each one's exit
status; launchers that cannot succeed any more fail the start at once
(:mod:`._launch_watch`); ssh hosts are checked first (:mod:`._ssh_check`); ranks whose
kernel dies exit by themselves (:mod:`._rank_agent`). The ``multihost`` tests run all
of it on simulated hosts.

Not done: restarting a single rank (a group cannot take a rank back; the whole group is
restarted), keeping rank state across ``restart()``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from fsdp_interactive.pool import _engine_shell, _hosts, _logs, _torch_recorder
from fsdp_interactive.pool._agent_client import RankAgents
from fsdp_interactive.pool._agent_wire import derive_key
from fsdp_interactive.pool._collectives import CollectiveTrace, diagnose
from fsdp_interactive.pool._diagnosis import Diagnosis
from fsdp_interactive.pool._dispatch import (
    InterruptReport,
    PendingCall,
    RankWatch,
    Targets,
    Unfinished,
    check_timeout,
    dead_ranks,
    purge_results,
    resolve_targets,
    signal_ranks,
)
from fsdp_interactive.pool._output import OutputSink, RunResult, run_result
from fsdp_interactive.pool._placement import check_request, plan
from fsdp_interactive.pool._processes import BROKEN_STOP_TIMEOUT_S, LaunchedProcesses
from fsdp_interactive.pool._rendezvous import Group, Rendezvous, connect_client, leave_group
from fsdp_interactive.pool._state import PoolState
from fsdp_interactive.pool._topology import RankRecord, format_table
from fsdp_interactive.pool.errors import START, PoolError, PoolNotRunning, Step

log = logging.getLogger(__name__)

#: Flight-recorder entries per rank unless ``flight_recorder=`` or the environment says.
DEFAULT_FLIGHT_RECORDER = 64
_INTERRUPT_CHECK_S = 1.0
#: Seconds to wait, after a rank died, for the deaths that come with it.
_DEATHS_SETTLE_S = 0.5

# Running pools are held here until stopped, so one is never garbage-collected while
# its processes run; at interpreter exit every pool still here is stopped.
_live_pools: set[Pool] = set()


def _stop_live_pools() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.stop()


atexit.register(_stop_live_pools)


class DebuggerOutput(str):
    """What one post-mortem debugger command printed; ``active``: the session goes on."""

    active: bool

    def __new__(cls, text: str, active: bool) -> DebuggerOutput:
        output = super().__new__(cls, text)
        output.active = active
        return output


class Pool:
    """A pool of ``n`` engines, each one ``torch.distributed`` rank.

    Parameters
    ----------
    n:
        Number of ranks (>= 1). Default: the number of visible CUDA devices (or of
        ``devices``), else 2 CPU ranks.
    devices:
        CUDA device indices, one per local rank (any subset, e.g. ``[1, 3]``; indices as
        the engines see them under the current ``CUDA_VISIBLE_DEVICES``), or ``"cpu"``
        for CPU ranks. Default: CUDA devices ``0..n-1`` when CUDA is visible, else CPU.
    backend:
        ``"nccl"`` or ``"gloo"``; default ``nccl`` on CUDA, ``gloo`` on CPU.
        ``backend="gloo"`` without ``devices`` gives CPU ranks.
    engines:
        ipyparallel engine launcher (``"local"``, ``"ssh"``, ``"slurm"``, ``"mpi"``, ...).
        Other keyword arguments go to ``ipyparallel.Cluster`` unchanged (e.g.
        ``profile_dir``, ``controller_ip``, ``config``).
    timeout:
        Seconds for start-up: engines registering plus process-group creation.
    pg_timeout:
        ``torch.distributed`` process-group timeout in seconds (default 600): a
        collective waiting longer than this fails on the ranks. The pool's own watchdog
        (``timeout=`` of ``run``/``call``) reports hangs sooner, without killing anything.
    show_topology:
        Print the rank table when the pool starts.
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
        **cluster_kwargs: Any,
    ) -> None:
        self._request = check_request(n, devices, backend)
        if flight_recorder is not None and (
            isinstance(flight_recorder, bool)
            or not isinstance(flight_recorder, int)
            or flight_recorder < 0
        ):
            raise ValueError(
                "flight_recorder must be a number of entries >= 0 (0: off) or None, "
                f"got {flight_recorder!r}"
            )
        if not isinstance(check_collectives, bool):
            raise ValueError(f"check_collectives must be True or False, got {check_collectives!r}")
        for name, value in (("timeout", timeout), ("pg_timeout", pg_timeout)):
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(engines, str) or not engines:
            raise ValueError(f"engines must be a launcher name such as 'local', got {engines!r}")
        _hosts.check_controller_ip(cluster_kwargs.get("controller_ip"))
        self._log_level = _logs.parse_level(log_level)
        if self._log_level is None:
            self._log_level = _logs.level_from_env()
        self.engines = engines
        self.timeout = float(timeout)
        self.pg_timeout = float(pg_timeout)
        self.show_topology = show_topology
        self.interrupt_grace = float(interrupt_grace)
        self.flight_recorder = flight_recorder
        self.check_collectives = check_collectives
        self._cluster_kwargs = dict(cluster_kwargs)
        self._connect_kwargs: dict[str, Any] | None = None

        self._state = PoolState.STOPPED
        self._processes = LaunchedProcesses(log_level=self._log_level)
        self._client: Any = None
        self._group: Group | None = None
        self._diagnosis: Diagnosis | None = None
        self._run_dir: str | None = None
        self._unfinished = Unfinished()
        self._cleanup: threading.Thread | None = None
        #: True after an interrupt landed inside torch.distributed; restart() clears it.
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
        registered when the pool starts (at least one is waited for). The pool does not own these engines: ``stop()`` leaves the process
        group and disconnects, but does not end the engines; ``restart()`` re-creates
        the group on the same engines.
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
    def topology(self) -> list[RankRecord]:
        """One record per rank, in rank order (empty when not running)."""
        return list(self._group.records) if self.running and self._group else []

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
        self._finish_cleanup()
        if self.running:
            return self
        if self._state is PoolState.BROKEN:
            self._teardown()
        if self._log_level is not None:
            _logs.enable(self._log_level)
        placement = plan(
            self._request, local_engines=self.engines == "local", connecting=not self.owns_engines
        )
        log.debug("starting: %s, engines=%r", placement, self.engines)
        began = time.monotonic()
        self._state = PoolState.STARTING
        _live_pools.add(self)
        self._run_dir = tempfile.mkdtemp(prefix="fsdpi-pool-")
        try:
            rendezvous = self._open(placement.n)
            n = placement.n or len(self._client.ids)
            self._group = rendezvous.form_group(n, placement)
            for record in self._group.records:
                self._processes.alias(record.pid, self._group.parent_pids.get(record.rank))
            agents = RankAgents(
                self._group.agents, derive_key(self._client.session.key, self._group.nonce)
            )
            agents.open_links()
            self._diagnosis = Diagnosis(
                self._group.records,
                agents=agents,
                thread_ids=self._group.thread_ids,
                signal=self._signal,
            )
            rendezvous.set_up_namespaces(self._group)
        except BaseException:
            log.debug(
                "start-up failed after %.2fs; stopping what was started", time.monotonic() - began
            )
            self._teardown()
            raise
        self._state = PoolState.RUNNING
        self.needs_restart = False
        log.debug("running: %d ranks, started in %.2fs", n, time.monotonic() - began)
        if self.show_topology:
            print(self.topology_table(), flush=True)
        return self

    def _open(self, n: int | None) -> Rendezvous:
        """Launch the cluster (or connect to it) and wait for its engines to register."""
        deadline = time.monotonic() + self.timeout
        assert self._run_dir is not None
        if self.owns_engines:
            assert n is not None
            self._client = self._processes.launch(
                n,
                engines=self.engines,
                cluster_kwargs=self._cluster_kwargs,
                timeout=self.timeout,
                run_dir=self._run_dir,
            )
        else:
            assert self._connect_kwargs is not None
            self._client = connect_client(self._connect_kwargs)
        rendezvous = Rendezvous(
            self._client,
            timeout=self.timeout,
            pg_timeout=self.pg_timeout,
            engines_exited=self._processes.exited_engines,
            launch_problem=self._processes.launch_problem if self.owns_engines else lambda: None,
            launch_state=self._processes.launch_state if self.owns_engines else lambda: "",
            log_level=self._log_level,
            flight_recorder=self._flight_recorder_entries(),
            check_collectives=self.check_collectives,
            owned=self.owns_engines,
        )
        rendezvous.wait_for_engines(n or 1, deadline)
        if self.owns_engines:
            self._processes.record()  # nannies and children that came up since the launch
        return rendezvous

    def _flight_recorder_entries(self) -> int | None:
        """The ranks' ring-buffer size: as asked, else the environment's, else the default."""
        if self.flight_recorder is not None:
            return self.flight_recorder
        if os.environ.get(_torch_recorder.BUFFER_ENV):
            return None  # the engines inherit the variable
        return DEFAULT_FLIGHT_RECORDER

    def stop(self) -> None:
        """End the group and the processes this pool started; idempotent.

        Owned clusters are stopped through ipyparallel's launcher handles (SIGTERM, then
        SIGKILL after a grace period); any recorded pid still alive afterwards is killed
        by that exact pid. A connected (not owned) cluster is only left and disconnected.
        """
        self._finish_cleanup()
        self._teardown()

    def restart(self) -> Pool:
        """A fresh process group without restarting the notebook kernel.

        Owned engines are stopped and started again (all rank state is lost);
        connected engines leave the old group and form a new one.
        """
        self._finish_cleanup()
        self._teardown(keep_forker=True)
        return self.start()

    def interrupt(self, targets: Targets = None) -> InterruptReport:
        """Send SIGINT to the targeted ranks (through ipyparallel's nanny); say what it did.

        When ranks still run a call that timed out or was interrupted, waits up to
        ``interrupt_grace`` seconds for those calls to end and reports per rank whether
        it stopped; a rank blocked inside a collective cannot be freed by SIGINT (the
        signal is handled only when the C++ call returns): it is reported as blocked
        and the pool then needs ``restart()``. Called while another thread waits on a
        call, it only signals (that call reports the outcome).
        """
        self._require_running()
        ranks = resolve_targets(targets, self.world_size)
        busy = [rank for rank in self._unfinished.busy_ranks() if rank in ranks]
        log.debug("pool.interrupt(): SIGINT to ranks %s (busy: %s)", ranks, busy)
        self._signal(ranks, signal.SIGINT)
        if not busy:
            return InterruptReport(signalled=ranks, idle=ranks)
        assert self._diagnosis is not None
        began = time.monotonic()
        still: list[int] = busy
        blocked: dict[int, str] = {}
        while still and time.monotonic() - began < self.interrupt_grace:
            time.sleep(0.05)
            still = [rank for rank in self._unfinished.busy_ranks() if rank in busy]
            if still and time.monotonic() - began > _INTERRUPT_CHECK_S and not blocked:
                blocked = self._diagnosis.blocked_in_collective(still)
                if set(blocked) == set(still):
                    break  # nothing left that SIGINT can stop
        still = [rank for rank in self._unfinished.busy_ranks() if rank in busy]
        if still:
            blocked = self._diagnosis.blocked_in_collective(still)
        running = {}
        if set(still) - set(blocked):
            report = self._diagnosis.stacks(ranks=[r for r in still if r not in blocked])
            running = report.where
        if blocked:
            self.needs_restart = True
            self._unfinished.blocked |= set(blocked)
        stopped = [rank for rank in busy if rank not in still]
        idle = [rank for rank in ranks if rank not in busy]
        return InterruptReport(ranks, stopped, blocked, running, idle)

    def _teardown(
        self, keep_forker: bool = False, final_state: PoolState = PoolState.STOPPED
    ) -> None:
        """Stop what this pool started (owned) or leave the group (connected).

        ``keep_forker``: leave the engine forker running, for a restart to fork from;
        ``final_state``: the state afterwards.
        """
        if self._state is not PoolState.STOPPED:
            log.debug("tearing down (state %s)", self._state)
        client, group = self._client, self._group
        if client is not None and not self.owns_engines and group is not None and group.records:
            with contextlib.suppress(Exception):
                leave_group(client, group.records)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if self._diagnosis is not None:
            self._diagnosis.close()
        self._processes.stop(
            keep_forker=keep_forker,
            engines_timeout=BROKEN_STOP_TIMEOUT_S if final_state is PoolState.BROKEN else None,
        )
        if self._run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        self._client = self._group = self._diagnosis = self._run_dir = None
        self._unfinished.clear()
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
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a string of Python source, got {type(code).__name__}")
        if cell is not None and (isinstance(cell, bool) or not isinstance(cell, int) or cell < 0):
            raise ValueError(f"cell must be the notebook's execution count (an int), got {cell!r}")
        views = self._begin(targets, timeout)
        started = time.monotonic()
        # The cell number travels in the code's own request: one message per rank.
        sent = code if cell is None else _engine_shell.mark_cell(code, cell)
        handles = {r: view.execute(sent, block=False, silent=False) for r, view in views.items()}
        return self._pending(
            handles,
            stream=stream,
            on_output=on_output,
            code=code,
            cell=f"Cell In[{cell}]" if cell is not None else None,
            native=native,
            finish=lambda _: run_result(handles, time.monotonic() - started),
        ).wait(timeout)

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
        printed by ``fn`` is streamed tagged by rank.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        views = self._begin(targets, timeout)
        handles = {r: view.apply_async(fn, *args, **kwargs) for r, view in views.items()}
        return self._pending(handles, stream=True).wait(timeout)

    def push(self, mapping: Mapping[str, Any], targets: Targets = None) -> None:
        """Assign each ``name: value`` of ``mapping`` in the targeted ranks' namespaces."""
        if not isinstance(mapping, Mapping) or not all(isinstance(k, str) for k in mapping):
            raise TypeError("mapping must be a mapping of variable names (str) to values")
        views = self._begin(targets, None)
        handles = {r: view.push(dict(mapping), block=False) for r, view in views.items()}
        self._pending(handles).wait()

    def pull(self, name: str, targets: Targets = None) -> list[Any]:
        """The value of ``name`` in each targeted rank's namespace, in rank order."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be a variable name, got {name!r}")
        views = self._begin(targets, None)
        handles = {r: view.pull(name, block=False) for r, view in views.items()}
        return self._pending(handles).wait()

    def busy_ranks(self) -> list[int]:
        """Ranks still running a call that timed out or was interrupted."""
        return self._unfinished.busy_ranks()

    def stacks(
        self, code: str | None = None, *, native: bool = False
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Every rank's current Python stack, without stopping any rank.

        Returns ``(stacks, where)``: ``stacks[rank]`` in traceback order with each
        frame's source line, and ``where[rank]`` a one-line summary. ``native=True``
        appends py-spy's native (C/C++) frames of each rank's user thread, run on the
        rank's host (needs py-spy there and ptrace permission; see
        :func:`~._thread_stacks.native_stack`). Ranks answer through their diagnostics
        agents; a rank whose agent cannot answer is asked by signal instead.
        """
        self._require_running()
        assert self._diagnosis is not None
        report = self._diagnosis.stacks(code=code, native=native)
        stacks = dict(report.stacks)
        if native:
            for rank, text in report.native.items():
                stacks[rank] += f"\n--- native stack (py-spy) ---\n{text}"
        return stacks, report.where

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
        self._require_running()
        if isinstance(last, bool) or not isinstance(last, int) or last < 1:
            raise ValueError(f"last must be a number of collectives >= 1, got {last!r}")
        assert self._diagnosis is not None
        ranks = resolve_targets(targets, self.world_size)
        dumps = self._diagnosis.trace(ranks, issued_at=issued_at)
        busy = set(self._unfinished.busy_ranks())
        findings = diagnose(dumps, finished=[r for r in ranks if r not in busy])
        silent = [rank for rank in ranks if rank not in dumps]
        if silent:
            findings.append(f"no answer from the agents of ranks {silent}")
        return CollectiveTrace(dumps, findings, last)

    def debug(self, rank: int, command: str | None = None) -> DebuggerOutput:
        """Run one pdb ``command`` on the last exception a notebook cell raised on ``rank``.

        The session lives on between calls (``up`` stays up) until ``q``; without a
        command it starts (or shows where it stands). Returns pdb's output. Cells count
        when run with ``run(..., cell=N)`` (as ``%%fsdp`` does). Raises ``PoolError`` when
        the rank has no failure to look at.
        """
        self._require_running()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank!r}")
        if command is not None and not isinstance(command, str):
            raise TypeError(f"command must be a pdb command (str) or None, got {command!r}")
        reply = self._debug(rank, command)
        return DebuggerOutput(reply["output"], active=bool(reply["active"]))

    def _debug(self, rank: int, command: str | None) -> dict[str, Any]:
        assert self._diagnosis is not None
        try:
            reply = self._diagnosis.agents.ask_one(rank, {"op": "debug", "command": command})
        except OSError as error:
            raise PoolError(f"rank {rank}'s diagnostics agent did not answer: {error}") from None
        if reply.get("failure") is None:
            raise PoolError(
                f"rank {rank} has no failure to debug: no cell run on the ranks "
                "(%%fsdp, or pool.run(..., cell=N)) raised there since the pool started"
            )
        return reply

    # ------------------------------------------------------------------ calls' plumbing

    def _require_running(self) -> None:
        if self._state is PoolState.BROKEN:
            raise PoolNotRunning(
                "a rank died and the group was torn down",
                Step("call {}", "pool.restart()", "%fsdp restart"),
            )
        if self._state is not PoolState.RUNNING:
            raise PoolNotRunning("the pool is not running", START)

    def _begin(self, targets: Targets, timeout: float | None) -> dict[int, Any]:
        """The views of the targeted ranks, once the pool can take a call."""
        self._require_running()
        check_timeout(timeout)
        ranks = resolve_targets(targets, self.world_size)
        self._unfinished.refuse_if_busy()
        assert self._group is not None
        return {rank: self._group.views[rank] for rank in ranks}

    def _pending(self, handles: dict[int, Any], **options: Any) -> PendingCall:
        assert self._diagnosis is not None
        watch = RankWatch(
            dead_ranks=self._dead_ranks,
            fail_dead=self._fail_dead,
            signal=self._signal,
            diagnosis=self._diagnosis,
            unfinished=self._unfinished,
            needs_restart=self._mark_needs_restart,
            purge=functools.partial(purge_results, self._client),
            interrupt_grace=self.interrupt_grace,
        )
        return PendingCall(handles, watch=watch, **options)

    def _mark_needs_restart(self) -> None:
        self.needs_restart = True

    def _dead_ranks(self) -> list[int]:
        records = self._group.records if self._group else []
        dead = set(dead_ranks(self._client, records, self._processes.engine))
        if self._diagnosis is not None:
            # A rank's link to its agent closes the moment its process ends, on any host;
            # the controller hears of a host that vanished only at its heartbeat timeout.
            lost = self._diagnosis.agents.lost()
            if lost:
                log.debug("ranks %s: their diagnostics links closed", lost)
            dead.update(lost)
        return sorted(dead)

    def _fail_dead(self, dead: list[int]) -> NoReturn:
        """Report how ranks died and raise RankDied; the survivors are ended and the group
        torn down meanwhile, on a thread (with remote engines that takes ssh round trips
        per engine), which every later start, stop or restart waits for first."""
        assert self._diagnosis is not None
        # Ranks that die together (a host that vanished) are seen one poll apart.
        time.sleep(_DEATHS_SETTLE_S)
        dead = sorted(set(dead) | set(self._dead_ranks()))
        error = self._diagnosis.death_error(dead, self._processes.engine)
        self._state = PoolState.BROKEN

        def clean_up() -> None:
            began = time.monotonic()
            try:
                self._processes.kill_engines()
                self._teardown(final_state=PoolState.BROKEN)
            finally:
                log.debug("the broken group was torn down in %.2fs", time.monotonic() - began)

        self._cleanup = threading.Thread(target=clean_up, name="fsdp-interactive-teardown")
        self._cleanup.start()
        raise error

    def _finish_cleanup(self) -> None:
        """Wait for the teardown of a group that lost a rank, if one is under way."""
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None and cleanup is not threading.current_thread():
            cleanup.join()

    def _signal(self, ranks: list[int], sig: int) -> None:
        if ranks and self._group is not None:
            signal_ranks(self._client, self._group.records, ranks, sig, self._processes.engine)
