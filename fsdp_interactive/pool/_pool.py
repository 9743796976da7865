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
* ``stop()`` ends exactly the processes the pool started (through ipyparallel's launcher
  handles, then by recorded pid if any survive); it also runs at interpreter exit.

Mechanisms:

* Start-up: local engines are forked from one process that imports torch while the
  controller starts (:mod:`._forked_launcher`, :mod:`._engine_forker`); they wait for
  the controller's connection file themselves (:mod:`._engine_entry`), so controller,
  torch import and engine start-up overlap instead of following each other.
  ``restart()`` keeps that process and forks fresh engines from it. An ``engines=``
  launcher other than ``"local"``, or an ipyparallel ``config`` that sets the engine
  command, gets ipyparallel's own launchers unchanged.
* Rendezvous: rank 0 opens a ``TCPStore`` on a port it binds itself (no free-port race),
  all ranks call ``init_process_group`` concurrently on it, then count themselves in on
  the store and wait for the full count; one ``all_reduce`` checks the backend.
* Stacks: each rank registers ``faulthandler`` on SIGUSR1 writing to a per-rank file;
  the pool sends the signal through ipyparallel's nanny (``Client.send_signal``) and
  reads the file. The dump is written from the C signal handler, so it works while the
  rank's main thread is blocked inside a C++ collective, and nothing is interrupted.
* Death: every poll checks that each rank's engine is still registered (the nanny
  reports an exit to the controller at once) and, for local engines, that its process
  is alive; the launcher handle gives the exit status, the engine log its last lines.
  Survivors are killed through their launcher handles, since a collective with a dead
  peer may never return (NCCL) and ``SIGTERM`` handlers do not run inside C++.
* Interrupt: engines run in their own session (ipyparallel's local launchers), so a
  notebook interrupt reaches only the kernel; the pool forwards SIGINT to the ranks
  through the nanny, waits ``interrupt_grace`` seconds, and reports ranks that did not
  stop, with where they are.

Multi-node (not exercised by the test-suite, which runs on one host): any ipyparallel
engine launcher can be named with ``engines=`` (its options pass through, including
``controller_ip`` which a multi-host cluster needs, since the controller listens on
loopback by default), or ``Pool.connect()`` joins a running cluster. Ranks of one host
are contiguous, ``LOCAL_RANK`` counts within a host, ``MASTER_ADDR`` is rank 0's
address and the rendezvous store then listens on all interfaces; stack files of ranks
on other hosts stay on those hosts (their path is reported) and exit statuses of remote
engines are unknown.

Not done: restarting a single rank (a group cannot take a rank back; the whole group is
restarted), keeping rank state across ``restart()``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import psutil

from fsdp_interactive.pool import _rank_bootstrap as rank_side
from fsdp_interactive.pool._devices import visible_cuda_device_count
from fsdp_interactive.pool._engine_entry import engine_command
from fsdp_interactive.pool._loop import LoopThread
from fsdp_interactive.pool._output import OutputSink, RunResult, TaggedPrinter, plain_result
from fsdp_interactive.pool._reaper import end_processes, start_reaper, write_pid_file
from fsdp_interactive.pool._stacks import describe, format_stack, in_distributed, user_stack
from fsdp_interactive.pool._topology import RankRecord, RankSlot, assign_ranks, format_table
from fsdp_interactive.pool.errors import (
    PoolBusy,
    PoolNotRunning,
    PoolStartError,
    RankDied,
    RankError,
    RankInterrupted,
    RankTimeout,
    strip_ansi,
)

_POLL_S = 0.05
_LOG_TAIL_LINES = 20
_STACK_WAIT_S = 3.0
_OUTPUT_GRACE_S = 2.0

# Running pools are held here until stopped, so one is never garbage-collected while
# its processes run; at interpreter exit every pool still here is stopped.
_live_pools: set[Pool] = set()


def _stop_live_pools() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.stop()


atexit.register(_stop_live_pools)

Targets = int | Sequence[int] | str | None


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
        **cluster_kwargs: Any,
    ) -> None:
        self._n_requested = _check_n(n)
        self._devices_requested = _check_devices(devices)
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
        if backend == "nccl" and self._devices_requested == "cpu":
            raise ValueError("backend='nccl' needs CUDA devices, but devices='cpu'")
        if isinstance(self._devices_requested, list) and self._n_requested is not None:
            if self._n_requested > len(self._devices_requested):
                raise ValueError(
                    f"n={self._n_requested} ranks but only {len(self._devices_requested)} "
                    f"devices given (devices={self._devices_requested}); one device per rank"
                )
            if self._n_requested < len(self._devices_requested):
                raise ValueError(
                    f"n={self._n_requested} but {len(self._devices_requested)} devices given; "
                    "pass as many devices as ranks (or leave n out)"
                )
        for name, value in (("timeout", timeout), ("pg_timeout", pg_timeout)):
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(engines, str) or not engines:
            raise ValueError(f"engines must be a launcher name such as 'local', got {engines!r}")
        self._backend_requested = backend
        self.engines = engines
        self.timeout = float(timeout)
        self.pg_timeout = float(pg_timeout)
        self.show_topology = show_topology
        self.interrupt_grace = float(interrupt_grace)
        self._cluster_kwargs = dict(cluster_kwargs)
        self._connect_kwargs: dict[str, Any] | None = None

        self._loop: LoopThread | None = None
        self._cluster: Any = None
        self._client: Any = None
        self._views: dict[int, Any] = {}
        self._records: list[RankRecord] = []
        self._launchers_by_pid: dict[int, Any] = {}
        self._state = "stopped"
        self._stack_dir: str | None = None
        self._reaper: Any = None
        self._forker: Any = None  # an EngineForker once local engines were forked
        self._thread_ids: dict[int, int] = {}
        self._stack_paths: dict[int, str] = {}
        self._last_frames: dict[int, list[Any]] = {}
        # per-rank handles of calls that timed out or were interrupted but still run
        self._unfinished: dict[int, list[Any]] = {}
        #: Every pid this pool started (controller, engines, their nannies), across restarts.
        self.launched_pids: dict[int, float] = {}
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
        return self._state == "running"

    @property
    def state(self) -> str:
        """``"stopped"``, ``"running"`` or ``"broken"`` (a rank died; call ``restart()``)."""
        return self._state

    @property
    def topology(self) -> list[RankRecord]:
        """One record per rank, in rank order (empty when not running)."""
        return list(self._records) if self.running else []

    @property
    def world_size(self) -> int:
        return len(self._records) if self.running else 0

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
        if self.running:
            return self
        if self._state == "broken":
            self._teardown()
        placement = self._plan_devices()
        self._loop = LoopThread()
        _live_pools.add(self)
        self._stack_dir = tempfile.mkdtemp(prefix="fsdpi-stacks-")
        try:
            n = self._launch_or_connect(placement["n"])
            self._form_group(n, placement)
        except BaseException:
            self._teardown()
            raise
        self._state = "running"
        self.needs_restart = False
        if self.show_topology:
            print(self.topology_table(), flush=True)
        return self

    def stop(self) -> None:
        """End the group and the processes this pool started; idempotent.

        Owned clusters are stopped through ipyparallel's launcher handles (SIGTERM, then
        SIGKILL after a grace period); any recorded pid still alive afterwards is killed
        by that exact pid. A connected (not owned) cluster is only left and disconnected.
        """
        self._teardown()

    def restart(self) -> Pool:
        """A fresh process group without restarting the notebook kernel.

        Owned engines are stopped and started again (all rank state is lost);
        connected engines leave the old group and form a new one.
        """
        self._teardown(keep_forker=True)
        return self.start()

    def interrupt(self, targets: Targets = None) -> None:
        """Send SIGINT to the targeted ranks (through ipyparallel's nanny) and return."""
        self._require_running()
        ranks = self._resolve_targets(targets)
        self._signal(ranks, signal.SIGINT)

    # ------------------------------------------------------------------ work

    def run(
        self,
        code: str,
        targets: Targets = None,
        timeout: float | None = None,
        stream: bool = True,
        *,
        on_output: OutputSink | None = None,
    ) -> RunResult:
        """Execute ``code`` on the targeted ranks concurrently; return their output.

        The code runs in each engine's persistent namespace, which the pool pre-fills
        with ``torch``, ``dist`` (``torch.distributed``), ``rank``, ``world_size``,
        ``local_rank`` and ``device``. With ``stream=True`` output is printed while the
        ranks run, each line tagged ``[rank N]`` (or handed to ``on_output(rank, stream,
        text)`` when given). ``timeout`` (seconds, default none) arms the hang watchdog.
        A cell that runs collectives must target every rank, or it will hang.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a string of Python source, got {type(code).__name__}")
        ranks = self._begin(targets, timeout)
        started = time.monotonic()
        handles = {r: self._views[r].execute(code, block=False, silent=False) for r in ranks}

        def finish(_: list[Any]) -> RunResult:
            result = RunResult(ranks=ranks, elapsed=time.monotonic() - started)
            for rank, handle in handles.items():
                metadata = _metadata(handle)
                result.stdout[rank] = metadata["stdout"]
                result.stderr[rank] = metadata["stderr"]
                execute_result = metadata.get("execute_result") or {}
                result.results[rank] = plain_result(execute_result)
                result.result_data[rank] = dict(execute_result.get("data") or {})
                result.displays[rank] = [
                    {"data": out.get("data", {}), "metadata": out.get("metadata", {})}
                    for out in metadata.get("outputs", [])
                ]
            return result

        return self._await(handles, timeout, stream, on_output, code=code, finish=finish)

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
        ranks = self._begin(targets, timeout)
        handles = {r: self._views[r].apply_async(fn, *args, **kwargs) for r in ranks}
        return self._await(handles, timeout, True, None)

    def push(self, mapping: Mapping[str, Any], targets: Targets = None) -> None:
        """Assign each ``name: value`` of ``mapping`` in the targeted ranks' namespaces."""
        if not isinstance(mapping, Mapping) or not all(isinstance(k, str) for k in mapping):
            raise TypeError("mapping must be a mapping of variable names (str) to values")
        ranks = self._begin(targets, None)
        handles = {r: self._views[r].push(dict(mapping), block=False) for r in ranks}
        self._await(handles, None, False, None)

    def pull(self, name: str, targets: Targets = None) -> list[Any]:
        """The value of ``name`` in each targeted rank's namespace, in rank order."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be a variable name, got {name!r}")
        ranks = self._begin(targets, None)
        handles = {r: self._views[r].pull(name, block=False) for r in ranks}
        return self._await(handles, None, False, None)

    # ------------------------------------------------------------------ start-up steps

    def _plan_devices(self) -> dict[str, Any]:
        """Decide n, device kind and backend before anything is started."""
        devices = self._devices_requested
        backend = self._backend_requested
        n = self._n_requested
        # Connecting to a running cluster with no n: take every engine that registered.
        default_cpu_n = None if self._connect_kwargs is not None else 2
        if devices == "cpu" or (devices is None and backend == "gloo"):
            return {"n": n or default_cpu_n, "devices": None, "backend": "gloo"}
        visible = visible_cuda_device_count() if self.engines == "local" else None
        if isinstance(devices, list):
            if visible is not None:
                missing = [d for d in devices if d >= visible]
                if missing:
                    raise ValueError(
                        f"devices {missing} not present: {visible} CUDA device(s) visible "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
                    )
            return {"n": len(devices), "devices": devices, "backend": backend or "nccl"}
        if visible:
            count = n if n is not None else visible
            if count > visible:
                raise ValueError(
                    f"n={count} ranks but only {visible} CUDA device(s) visible; "
                    "pass devices='cpu' (or backend='gloo') for CPU ranks"
                )
            return {"n": count, "devices": list(range(count)), "backend": backend or "nccl"}
        if visible is None and backend == "nccl":
            # Remote engines: trust the caller; join_group checks each device on its host.
            count = n if n is not None else 1
            return {"n": count, "devices": "local_rank", "backend": "nccl"}
        if backend == "nccl":
            raise ValueError("backend='nccl' needs CUDA devices, but none are visible")
        return {"n": n or default_cpu_n, "devices": None, "backend": "gloo"}

    def _launch_or_connect(self, n: int | None) -> int:
        import ipyparallel as ipp

        from fsdp_interactive.pool._forked_launcher import (
            ForkedEngineSetLauncher,
            forking_supported,
        )

        assert self._loop is not None
        deadline = time.monotonic() + self.timeout
        if self._connect_kwargs is not None:
            try:
                self._client = ipp.Client(**self._connect_kwargs)
            except Exception as exc:
                raise PoolStartError(f"could not connect to the cluster: {exc}") from exc
            self._wait_for_engines(n or 1, deadline)
            return n or len(self._client.ids)
        assert n is not None

        kwargs = dict(self._cluster_kwargs)
        kwargs.setdefault("log_level", logging.ERROR)
        # The pool stops its cluster at exit itself (engines first, on its own loop).
        kwargs.setdefault("shutdown_atexit", False)
        # Results are never fetched again from the controller: do not keep them there.
        # The controller completes an engine's registration at its next heartbeat; ping
        # every 0.3 s instead of 3 s (start-up waits on it), allowing 100 misses so a busy
        # engine is declared dead no sooner than before (death is reported by the nanny).
        kwargs.setdefault(
            "controller_args",
            [
                "--nodb",
                "--HeartMonitor.period=300",
                "--HeartMonitor.max_heartmonitor_misses=100",
            ],
        )
        kwargs.setdefault("engine_timeout", int(self.timeout))

        engines: Any = self.engines
        early_engines = (
            engines == "local"
            and forking_supported()
            and not {"send_engines_connection_env", "engine_launcher_class"} & set(kwargs)
            and not _configures_engine_command(kwargs.get("config"))
        )
        if early_engines:
            # Local engines are forked from one process that imported torch while the
            # controller started, and wait for its connection file themselves (see
            # _forked_launcher and _engine_entry); ipyparallel's own local launcher starts
            # each engine from scratch once the controller is up.
            kwargs["send_engines_connection_env"] = False
            engines = ForkedEngineSetLauncher

        async def launch() -> None:
            self._cluster = ipp.Cluster(n=n, engines=engines, **kwargs)
            await self._cluster.start_controller()
            engine_kwargs = {}
            if early_engines:
                connection_file = self._cluster.controller.connection_files["engine"]
                engine_kwargs["engine_cmd"] = engine_command(connection_file, self.timeout)
                engine_kwargs["forker"] = self._running_forker()
            await self._cluster.start_engines(n, **engine_kwargs)

        try:
            self._loop.run(launch, timeout=self.timeout)
        except Exception as exc:
            raise PoolStartError(f"could not launch the cluster: {exc}") from exc
        self._record_launched()
        self._client = self._loop.run(self._cluster.connect_client, timeout=self.timeout)
        self._wait_for_engines(n, deadline)
        self._record_launched()
        return n

    def _record_launched(self) -> None:
        """Remember pids (with start time) of controller, engines and their nannies."""
        cluster = self._cluster
        pids: list[int] = []
        if cluster.controller is not None and getattr(cluster.controller, "pid", -1) > 0:
            pids.append(cluster.controller.pid)
        for engine_set in cluster.engines.values():
            if getattr(engine_set, "forker_pid", None):
                pids.append(engine_set.forker_pid)
            for launcher in getattr(engine_set, "launchers", {}).values():
                if getattr(launcher, "pid", -1) > 0:
                    self._launchers_by_pid[launcher.pid] = launcher
                    pids.append(launcher.pid)
        for pid in list(pids):
            with contextlib.suppress(psutil.Error):
                pids += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self.launched_pids.setdefault(pid, psutil.Process(pid).create_time())
        self._arm_reaper()

    def _arm_reaper(self) -> None:
        """Keep the orphan reaper's pid file current, and start the reaper once.

        The reaper ends these processes if this (the owning) process dies without
        stopping the pool; see :mod:`fsdp_interactive.pool._reaper`.
        """
        assert self._stack_dir is not None
        pid_file = os.path.join(self._stack_dir, "launched.json")
        write_pid_file(pid_file, self.launched_pids)
        if self._reaper is None or self._reaper.poll() is not None:
            self._reaper = start_reaper(pid_file)

    def _wait_for_engines(self, n: int, deadline: float) -> None:
        while len(self._client.ids) < n:
            exited = [
                (pid, launcher)
                for pid, launcher in self._launchers_by_pid.items()
                if not _pid_alive(pid)
            ]
            if exited:
                pid, launcher = exited[0]
                raise PoolStartError(
                    f"engine process {pid} exited before registering; last lines of its log:\n"
                    + _launcher_tail(launcher)
                )
            if time.monotonic() > deadline:
                raise PoolStartError(
                    f"only {len(self._client.ids)} of {n} engines registered within "
                    f"timeout={self.timeout:g}s; everything started was stopped"
                )
            time.sleep(0.1)

    def _form_group(self, n: int, placement: dict[str, Any]) -> None:
        engine_ids = sorted(self._client.ids)[:n]
        described = self._gather_start(
            {eid: self._client[eid].apply_async(rank_side.describe_engine) for eid in engine_ids},
            "describing engines",
        )
        slots = assign_ranks(described)
        self._views = {slot.rank: self._client[slot.engine_id] for slot in slots}
        hosts = {slot.host for slot in slots}
        single_host = len(hosts) == 1
        master_addr = "127.0.0.1" if single_host else slots[0].address
        bind = "127.0.0.1" if single_host else ""
        port = self._gather_start(
            {
                0: self._views[0].apply_async(
                    rank_side.open_store, bind, n, min(self.pg_timeout, self.timeout)
                )
            },
            "opening the rendezvous store",
        )[0]
        env = _socket_env() if single_host else {}
        specs = {
            slot.rank: {
                "rank": slot.rank,
                "world_size": n,
                "local_rank": slot.local_rank,
                "local_world_size": slot.local_world_size,
                "master_addr": master_addr,
                "master_port": port,
                "backend": placement["backend"],
                "device": _device_for(placement["devices"], slot),
                "pg_timeout_s": self.pg_timeout,
                "stack_path": os.path.join(self._stack_dir or "", f"rank{slot.rank}.stack"),
                "env": env,
            }
            for slot in slots
        }
        joined = self._gather_start(
            {
                r: self._views[r].apply_async(rank_side.join_group, spec)
                for r, spec in specs.items()
            },
            "forming the process group",
        )
        self._records = [
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
            )
            for slot in slots
        ]
        self._thread_ids = {r: joined[r]["thread_id"] for r in joined}
        self._stack_paths = {r: joined[r]["stack_path"] for r in joined}
        self._state = "running"  # so that the namespace set-up below may use run()
        self.run(_NAMESPACE_SETUP, stream=False, timeout=self.timeout)
        self._state = "starting"

    def _gather_start(self, handles: dict[int, Any], what: str) -> dict[int, Any]:
        deadline = time.monotonic() + self.timeout
        while not all(h.ready() for h in handles.values()):
            if any(h.ready() and not h.successful() for h in handles.values()):
                break  # one failure is enough: peers may wait for it forever
            if time.monotonic() > deadline:
                raise PoolStartError(f"timed out after {self.timeout:g}s while {what}")
            if self._any_dead():
                raise PoolStartError(f"an engine process exited while {what}")
            time.sleep(_POLL_S)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        for key, handle in handles.items():
            if not handle.ready():
                continue
            try:
                results[key] = handle.get(0)
            except Exception as exc:
                failures[key] = _traceback_text(exc)
        if failures:
            first = min(failures)
            raise PoolStartError(f"failed while {what} (rank/engine {first}):\n{failures[first]}")
        return results

    def _any_dead(self) -> bool:
        return any(not _pid_alive(pid) for pid in self._launchers_by_pid)

    # ------------------------------------------------------------------ waiting

    def _begin(self, targets: Targets, timeout: float | None) -> list[int]:
        self._require_running()
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        ranks = self._resolve_targets(targets)
        busy = self.busy_ranks()
        if busy:
            raise PoolBusy(
                f"{'rank' if len(busy) == 1 else 'ranks'} {', '.join(map(str, busy))} "
                "still run an earlier call that timed out or was interrupted; new work would "
                "wait behind it. Wait for it (RankTimeout.wait()), interrupt it "
                "(pool.interrupt()) or start a fresh group (pool.restart())."
            )
        return ranks

    def busy_ranks(self) -> list[int]:
        """Ranks still running a call that timed out or was interrupted."""
        self._unfinished = {
            rank: [h for h in handles if not h.ready()]
            for rank, handles in self._unfinished.items()
        }
        return sorted(rank for rank, handles in self._unfinished.items() if handles)

    def _remember_unfinished(self, handles: dict[int, Any]) -> None:
        for rank, handle in handles.items():
            if not handle.ready():
                self._unfinished.setdefault(rank, []).append(handle)

    def _require_running(self) -> None:
        if self._state == "broken":
            raise PoolNotRunning("a rank died and the group was torn down: call pool.restart()")
        if self._state != "running":
            raise PoolNotRunning("the pool is not running: call pool.start()")

    def _resolve_targets(self, targets: Targets) -> list[int]:
        world = len(self._records)
        if targets is None or targets == "all":
            return list(range(world))
        if isinstance(targets, bool | str):
            raise ValueError(f"targets must be a rank, a list of ranks or 'all', got {targets!r}")
        chosen = [targets] if isinstance(targets, int) else list(targets)
        bad = [
            t for t in chosen if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < world
        ]
        if bad or not chosen:
            raise ValueError(f"targets must be ranks in 0..{world - 1} (or 'all'), got {targets!r}")
        return sorted(set(chosen))

    def _await(
        self,
        handles: dict[int, Any],
        timeout: float | None,
        stream: bool,
        on_output: OutputSink | None,
        code: str | None = None,
        finish: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """Wait for every handle, streaming output, watching for death, hang and Ctrl-C.

        Returns ``finish(per-rank results)`` (the plain list without ``finish``).
        """
        printer = TaggedPrinter() if on_output is None else None
        sink: OutputSink | None = (on_output or printer) if stream else None
        offsets: dict[tuple[int, str], int] = {}

        def pump() -> None:
            if sink is None:
                return
            for rank, handle in handles.items():
                metadata = _metadata(handle)
                for name in ("stdout", "stderr"):
                    text = metadata[name]
                    seen = offsets.get((rank, name), 0)
                    if len(text) > seen:
                        offsets[(rank, name)] = len(text)
                        sink(rank, name, text[seen:])

        def wait(limit: float | None) -> Any:
            end = None if limit is None else time.monotonic() + limit
            limit_text = f"{limit:g}s" if limit is not None else ""
            try:
                while True:
                    pending = [r for r, h in handles.items() if not h.ready()]
                    pump()
                    if not pending:
                        break
                    if end is not None and time.monotonic() > end:
                        self._remember_unfinished(handles)
                        raise self._timeout_error(pending, limit_text, code, wait)
                    handles[pending[0]].wait(_POLL_S)
                    if handles[pending[0]].ready():
                        continue  # progress: liveness is checked only when a wait ran out
                    dead = self._dead_ranks()
                    if dead:
                        self._die(dead)
                for handle in handles.values():
                    # stream messages may trail the reply; wait for them briefly
                    handle.wait_for_output(_OUTPUT_GRACE_S)
                pump()
            except KeyboardInterrupt:
                self._interrupted(handles, pump, code)
            finally:
                if printer is not None:
                    printer.flush()
            results = self._collect(handles)
            value = finish(results) if finish is not None else results
            # Results are handed over once: drop the client's cached copies (tensors
            # pulled every step would otherwise accumulate in the kernel).
            with contextlib.suppress(Exception):
                self._client.purge_local_results(jobs=list(handles.values()))
            return value

        return wait(timeout)

    def _collect(self, handles: dict[int, Any]) -> list[Any]:
        import ipyparallel as ipp

        results: list[Any] = []
        tracebacks: dict[int, str] = {}
        errors: dict[int, tuple[str, str]] = {}
        died: list[int] = []
        for rank, handle in handles.items():
            try:
                results.append(handle.get(0))
            except ipp.error.EngineError:
                died.append(rank)
            except ipp.error.RemoteError as exc:
                if exc.ename == "EngineError":
                    died.append(rank)
                    continue
                tracebacks[rank] = _traceback_text(exc)
                errors[rank] = (exc.ename, strip_ansi(str(exc.evalue)))
            except Exception as exc:
                tracebacks[rank] = _traceback_text(exc)
                errors[rank] = (type(exc).__name__, str(exc))
        if died:
            self._die(died)
        if tracebacks and all(errors[r][0] == "KeyboardInterrupt" for r in tracebacks):
            # interrupted through pool.interrupt() (or a signal) while we were waiting
            in_collective = [r for r, t in tracebacks.items() if _mentions_distributed(t)]
            if in_collective:
                self.needs_restart = True
            raise RankInterrupted(sorted(tracebacks), {}, in_collective)
        if tracebacks:
            raise RankError(tracebacks, errors)
        return results

    def _dead_ranks(self) -> list[int]:
        registered = set(self._client.ids)
        dead = []
        for record in self._records:
            gone = record.engine_id not in registered
            exited = record.pid in self._launchers_by_pid and not _pid_alive(record.pid)
            if gone or exited:
                dead.append(record.rank)
        return dead

    def _die(self, dead: list[int]) -> None:
        """Record how ranks died, tear the group down, raise RankDied."""
        records = {r.rank: r for r in self._records}
        tails = {}
        for rank in dead:
            launcher = self._launchers_by_pid.get(records[rank].pid)
            tails[rank] = _launcher_tail(launcher) if launcher else ""
        codes = {rank: self._exit_code(records[rank].pid) for rank in dead}
        hosts = {rank: records[rank].host for rank in dead}
        pids = {rank: records[rank].pid for rank in dead}
        # Survivors may be blocked in a collective that will never complete (NCCL waits
        # forever; SIGTERM handlers do not run inside C++). The group is lost anyway:
        # end them at once through their launchers' handles.
        for launcher in self._launchers_by_pid.values():
            with contextlib.suppress(Exception):
                launcher.signal(signal.SIGKILL)
        self._teardown()
        self._state = "broken"
        raise RankDied(dead, codes, tails, hosts=hosts, pids=pids)

    def _exit_code(self, pid: int) -> int | None:
        launcher = self._launchers_by_pid.get(pid)
        if launcher is None:
            return None
        end = time.monotonic() + 3.0
        while launcher.state != "after" and time.monotonic() < end:
            time.sleep(_POLL_S)
        stop_data = launcher.stop_data or {}
        code = stop_data.get("exit_code")
        return int(code) if isinstance(code, int) else None

    def _timeout_error(
        self,
        pending: list[int],
        limit: str,
        code: str | None,
        wait: Callable[[float | None], Any],
    ) -> RankTimeout:
        stacks, where = self.stacks(code=code)
        for rank in stacks:
            if rank not in pending:
                where[rank] = "finished this run; now " + where[rank]
        lines = [
            f"ranks {pending} did not finish within {limit}; they are still running:"
            if len(pending) > 1
            else f"rank {pending[0]} did not finish within {limit}; it is still running:"
        ]
        lines += [f"  rank {r}: {where[r]}" for r in sorted(where)]
        lines.append(
            "Keep waiting with err.wait(), interrupt with pool.interrupt(), "
            "or start a fresh group with pool.restart()."
        )
        for rank in pending:
            lines.append(f"--- rank {rank} stack (most recent call last) ---\n{stacks[rank]}")
        return RankTimeout("\n".join(lines), stacks, where, pending, wait)

    def stacks(self, code: str | None = None) -> tuple[dict[int, str], dict[int, str]]:
        """Every rank's current Python stack, without stopping any rank.

        Returns ``(stacks, where)``: ``stacks[rank]`` in traceback order and ``where[rank]``
        a one-line summary. Ranks signal themselves to dump (``faulthandler``) into a
        file the pool reads; for ranks on other hosts ``stacks`` names that file.
        """
        self._require_running()
        ranks = [r.rank for r in self._records]
        sizes = {r: _size(self._stack_paths[r]) for r in ranks}
        self._signal(ranks, rank_side.STACK_SIGNAL)
        local = socket.gethostname()
        dumps: dict[int, str] = {}
        end = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < end and len(dumps) < len(ranks):
            for rank in ranks:
                path = self._stack_paths[rank]
                if rank in dumps or self._records[rank].host != local:
                    continue
                if _size(path) > sizes[rank]:
                    time.sleep(_POLL_S)  # let the handler finish writing
                    with open(path) as f:
                        f.seek(sizes[rank])
                        dumps[rank] = f.read()
            if all(self._records[r].host != local or r in dumps for r in ranks):
                break
            time.sleep(_POLL_S)
        stacks: dict[int, str] = {}
        where: dict[int, str] = {}
        self._last_frames = {}
        for rank in ranks:
            if rank in dumps:
                frames = user_stack(dumps[rank], self._thread_ids.get(rank))
                self._last_frames[rank] = frames
                stacks[rank] = format_stack(frames)
                where[rank] = describe(frames, code)
            else:
                record = self._records[rank]
                stacks[rank] = f"(stack written on {record.host}:{self._stack_paths[rank]})"
                where[rank] = "unknown: no stack dump received"
        return stacks, where

    def _interrupted(
        self, handles: dict[int, Any], pump: Callable[[], None], code: str | None
    ) -> None:
        pending = [r for r, h in handles.items() if not h.ready()]
        self._signal(pending, signal.SIGINT)
        end = time.monotonic() + self.interrupt_grace
        while time.monotonic() < end and not all(h.ready() for h in handles.values()):
            pump()
            if self._dead_ranks():
                break
            time.sleep(_POLL_S)
        pump()
        dead = self._dead_ranks()
        if dead:
            self._die(dead)
        stuck_ranks = [r for r, h in handles.items() if not h.ready()]
        stuck: dict[int, str] = {}
        in_collective: list[int] = []
        if stuck_ranks and not self._dead_ranks():
            _, where = self.stacks(code=code)
            stuck = {r: where[r] for r in stuck_ranks}
            in_collective += [
                r for r in stuck_ranks if in_distributed(self._last_frames.get(r, [])) is not None
            ]
        for rank, handle in handles.items():
            if rank in stuck_ranks:
                continue
            with contextlib.suppress(Exception):
                handle.get(0)
                continue
            exc = handle.exception() if hasattr(handle, "exception") else None
            if exc is not None and _mentions_distributed(_traceback_text(exc)):
                in_collective.append(rank)
        if in_collective:
            self.needs_restart = True
        self._remember_unfinished(handles)
        raise RankInterrupted(pending, stuck, sorted(set(in_collective))) from None

    def _signal(self, ranks: Iterable[int], sig: int) -> None:
        """Signal ranks through the engines' nannies; fall back to local pids."""
        ranks = list(ranks)
        if not ranks:
            return
        engine_ids = [self._records[r].engine_id for r in ranks]
        try:
            self._client.send_signal(int(sig), targets=engine_ids, block=False).result(5)
        except Exception:
            for rank in ranks:
                record = self._records[rank]
                if record.pid in self._launchers_by_pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(record.pid, sig)

    # ------------------------------------------------------------------ teardown

    def _teardown(self, keep_forker: bool = False) -> None:
        """Stop what this pool started (owned) or leave the group (connected).

        ``keep_forker``: leave the engine forker running, for a restart to fork from.
        """
        client, cluster, loop = self._client, self._cluster, self._loop
        if client is not None and not self.owns_engines and self._records:
            with contextlib.suppress(Exception):
                ids = [r.engine_id for r in self._records if r.engine_id in client.ids]
                client[ids].apply_async(rank_side.leave_group).wait(10)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if cluster is not None and loop is not None:
            # Engines first: their nannies can then tell a live controller and exit at once.
            with contextlib.suppress(Exception):
                loop.run(cluster.stop_engines, timeout=60)
            with contextlib.suppress(Exception):
                loop.run(cluster.stop_controller, timeout=60)
        kept = self._forker if keep_forker and self._forker is not None else None
        self._reap_launched(spare=kept.pid if kept is not None else None)
        if kept is None:
            self._stop_forker()
        self._stop_reaper()
        if loop is not None:
            loop.close()
        if self._stack_dir:
            with contextlib.suppress(OSError):
                for name in os.listdir(self._stack_dir):
                    os.remove(os.path.join(self._stack_dir, name))
                os.rmdir(self._stack_dir)
        self._client = self._cluster = self._loop = None
        self._views = {}
        self._unfinished = {}
        self._records = []
        self._launchers_by_pid = {}
        self._stack_dir = None
        self._state = "stopped"
        _live_pools.discard(self)

    def _stop_reaper(self) -> None:
        """End the orphan reaper through the handle that started it."""
        reaper, self._reaper = self._reaper, None
        if reaper is None:
            return
        with contextlib.suppress(OSError):
            reaper.terminate()
        try:
            reaper.wait(timeout=10)
        except Exception:
            reaper.kill()
            reaper.wait(timeout=10)

    def _reap_launched(self, spare: int | None = None) -> None:
        """Kill, by exact pid and start time, any recorded process still alive but ``spare``."""
        end_processes({p: t for p, t in self.launched_pids.items() if p != spare}, grace=10)

    def _running_forker(self) -> Any:
        """The engine forker local engines are forked from; started once, kept by restart()."""
        from fsdp_interactive.pool._forked_launcher import EngineForker

        if self._forker is None or not self._forker.running():
            self._stop_forker()
            log_dir = os.path.join(self._cluster.profile_dir, "log")
            os.makedirs(log_dir, exist_ok=True)
            log = os.path.join(log_dir, f"ipengine-forker-{self._cluster.cluster_id}.log")
            self._forker = EngineForker(log, dict(os.environ))
        return self._forker

    def _stop_forker(self) -> None:
        """End the engine forker through its handle, if one runs."""
        forker, self._forker = self._forker, None
        if forker is not None:
            forker.close()


_NAMESPACE_SETUP = """\
import torch
import torch.distributed as dist
from fsdp_interactive.pool._rank_bootstrap import rank_context as _fsdpi_rank_context
rank, world_size, local_rank, device = _fsdpi_rank_context()
device = torch.device(device)
del _fsdpi_rank_context
"""


def _configures_engine_command(config: Any) -> bool:
    """Whether an ipyparallel ``config`` sets the local launchers' ``engine_cmd``."""
    if not config:
        return False
    sections = ("LocalEngineSetLauncher", "LocalEngineLauncher", "EngineLauncher")
    return any("engine_cmd" in config.get(section, {}) for section in sections)


def _check_n(n: Any) -> int | None:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (number of ranks), got {n!r}")
    return n


def _check_devices(devices: Any) -> list[int] | str | None:
    if devices is None or devices == "cpu":
        return devices
    if isinstance(devices, str) or not isinstance(devices, Iterable):
        raise ValueError(f"devices must be a list of CUDA device indices or 'cpu', got {devices!r}")
    chosen = list(devices)
    if not chosen or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in chosen):
        raise ValueError(f"devices must be non-negative CUDA device indices, got {devices!r}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"devices must not repeat (one device per rank), got {devices!r}")
    return chosen


def _device_for(devices: list[int] | str | None, slot: RankSlot) -> str:
    if devices is None:
        return "cpu"
    if devices == "local_rank":
        return f"cuda:{slot.local_rank}"
    assert isinstance(devices, list)
    return f"cuda:{devices[slot.local_rank]}"


def _socket_env() -> dict[str, str]:
    """Keep gloo's and NCCL's listeners on loopback for a single-host pool."""
    loopback = None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            loopback = name
            break
    env: dict[str, str] = {}
    if loopback is not None:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if var not in os.environ:
                env[var] = loopback
    return env


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _metadata(handle: Any) -> dict[str, Any]:
    """A single-engine AsyncResult's metadata dict, as received.

    ``AsyncResult.metadata`` parses every timestamp field with dateutil on each access
    until all have arrived, which was most of the pool's own cost per no-op round trip;
    only the output fields are read here, so the received dict is used as it is.
    """
    received = getattr(handle, "_metadata", None)
    if isinstance(received, list) and len(received) == 1 and isinstance(received[0], dict):
        return received[0]
    return handle.metadata


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _launcher_tail(launcher: Any, lines: int = _LOG_TAIL_LINES) -> str:
    """Last lines of an engine's log: from its file, or from what its launcher kept.

    A local launcher reads and removes the file when it notices the exit, so the file
    may already be gone.
    """
    text = ""
    path = getattr(launcher, "output_file", "")
    if path:
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            text = f.read()
    if not text:
        end = time.monotonic() + 2.0
        while launcher.state != "after" and time.monotonic() < end:
            time.sleep(_POLL_S)
        with contextlib.suppress(Exception):
            text = launcher.get_output() or ""
    all_lines = text.splitlines(keepends=True)
    fatal = [i for i, line in enumerate(all_lines) if line.startswith("Fatal Python error")]
    if fatal:
        # faulthandler's report of a crash (segfault, abort): keep it from its first line
        return "".join(all_lines[fatal[-1] : fatal[-1] + 3 * lines])
    return "".join(all_lines[-lines:])


def _mentions_distributed(traceback_text: str) -> bool:
    return "torch/distributed/" in traceback_text.replace("\\", "/")


def _traceback_text(exc: BaseException) -> str:
    remote = getattr(exc, "traceback", None)
    if isinstance(remote, str) and remote:
        return strip_ansi(remote)
    import traceback

    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
