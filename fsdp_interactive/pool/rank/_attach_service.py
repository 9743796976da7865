"""Rank side: what makes one rank of a job attachable, and the requests it serves.

:func:`start` (called by :mod:`fsdp_interactive.attachable` in every rank) makes the
job's folder under the attach dir (private folders, :mod:`fsdp_interactive._attach_records`),
listens on a Unix socket there (and, only where the job asks for it with ``listen``, on a
TCP port of that address, for notebooks on other hosts that cannot tunnel over ssh),
writes the rank's record with a fresh key, and removes both when the process exits. It
serves on the diagnostics agent (:mod:`._agent`: one daemon thread, each connection
authenticated by an HMAC challenge both ways under the rank's key), which answers
``stacks`` and ``trace`` as it does in a pool, plus:

* ``status`` -> ``{"state": RankState}`` (:mod:`._job_phase`);
* ``session`` opens the notebook's session link (:mod:`._attach_session`);
* with the session's id: ``pause`` (``step``; ``None``: the next) -> ``{"count",
  "target", "paused"}``;
  ``wait_paused`` (``timeout``) -> ``{"paused"}``; ``resume``; ``detach``; and, while
  paused, in the training thread: ``run`` (``code``, ``cell``) -> a
  :class:`._paused_cells.CellOutcome`; ``pull`` (``name``) -> ``{"value"}``; ``push``
  (``values``); ``call`` (``function``, ``args``, ``kwargs``) -> ``{"value"}``.

Nothing runs on the training thread while no notebook asks: the step boundary's hook
(:mod:`._step_boundary`) reads a counter per optimizer step, the agent's thread sleeps in
``accept``. No signal handler is installed (a job's own SIGUSR1, SLURM's preemption
warning, stays the job's): a rank whose agent cannot take the GIL does not answer.

Snapshots taken while attached go to a snapshot root of the job on each host (in host
memory, ``/dev/shm/fsdpi-<hash of the job's folder>``), sealed with a key the notebook
brings, unless the job set ``FSDPI_SNAPSHOT_ROOT`` itself; a detach removes that root and
puts the environment back.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from fsdp_interactive import _attach_records, _notices
from fsdp_interactive.pool.common import _snapshot_root
from fsdp_interactive.pool.rank import _agent, _job_phase, _results, _step_boundary
from fsdp_interactive.pool.rank._attach_session import Sessions
from fsdp_interactive.pool.rank._job_pause import JobPause
from fsdp_interactive.pool.rank._paused_cells import CellNamespace, code_name, run_cell

log = logging.getLogger(__name__)

#: Default seconds a paused rank waits for a notebook that went away.
DEFAULT_PAUSE_TIMEOUT_S = 300.0
#: The longest a job may choose: a pause is never kept for ever.
MAX_PAUSE_TIMEOUT_S = 24 * 3600.0


@dataclass(frozen=True)
class AttachOptions:
    """How a job makes itself attachable: ``attach_dir`` (``None``: the default),
    ``job`` (its name; ``None``: from the environment), ``listen`` (an address to also
    listen on over TCP, for notebooks on other hosts; ``None``: the Unix socket only),
    ``pause_timeout`` (seconds a pause outlives its notebook)."""

    attach_dir: str | None = None
    job: str | None = None
    listen: str | None = None
    pause_timeout: float = DEFAULT_PAUSE_TIMEOUT_S

    def checked(self) -> AttachOptions:
        timeout = self.pause_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (0 < timeout <= MAX_PAUSE_TIMEOUT_S)
        ):
            raise ValueError(
                f"pause_timeout must be seconds in (0, {MAX_PAUSE_TIMEOUT_S:.0f}], got {timeout!r}"
            )
        if self.job is not None:
            _attach_records.check_job_name(self.job)
        if self.listen is not None and self.listen in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"listen={self.listen!r} would listen on every interface; name the one "
                "address notebooks reach this host by"
            )
        return self


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return default


class AttachService:
    """One rank's attach service (see the module)."""

    def __init__(self, options: AttachOptions, training_thread: int) -> None:
        self.options = options.checked()
        self.rank = _env_int("RANK", "SLURM_PROCID", default=0)
        self.world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
        self.local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
        self.training_thread = training_thread
        self.job = options.job or _attach_records.job_name()
        self.folder = _attach_records.make_job_folder(
            _attach_records.attach_dir(options.attach_dir), self.job
        )
        self.boundary = _step_boundary.install()
        self.pause = JobPause(self.boundary, options.pause_timeout)
        self.sessions = Sessions(on_lost=self.pause.orphaned, on_goodbye=self._detached)
        self._key = secrets.token_bytes(32)
        self._agents: list[_agent.RankAgent] = []
        self._snapshot_env: dict[str, str | None] | None = None
        self._pid = os.getpid()
        self._closed = False
        self.record: _attach_records.AttachRecord | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> _attach_records.AttachRecord:
        path = _attach_records.socket_path(self.folder, self.rank)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by an earlier run of this rank
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(16)
        handlers = self._handlers()
        self._agents.append(self._agent(listener, handlers))
        address = None
        if self.options.listen is not None:
            tcp = self._agent(None, handlers)
            self._agents.append(tcp)
            address = tcp.address
        self.record = _attach_records.AttachRecord(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            key=self._key.hex(),
            socket=path,
            address=address if isinstance(address, tuple) else None,
            pause_timeout=float(self.options.pause_timeout),
            python=sys.executable,
            argv=tuple(sys.argv),
            started=time.time(),
        )
        _attach_records.write_record(self.folder, self.record)
        atexit.register(self.close)
        log.info("rank %d of job %s is attachable (%s)", self.rank, self.job, self.folder)
        return self.record

    def _agent(self, listener: socket.socket | None, handlers: dict[str, Any]) -> _agent.RankAgent:
        return _agent.RankAgent(
            self.options.listen or "127.0.0.1",
            self._key,
            user_thread=self.training_thread,
            code_name=code_name,
            rank=lambda: self.rank,
            listener=listener,
            handlers=handlers,
        )

    def close(self) -> None:
        """Stop serving and remove this rank's record (the process ends, or a test)."""
        if self._closed or os.getpid() != self._pid:
            return  # a forked child (a data loader worker) inherits this: not its to close
        self._closed = True
        self.sessions.notify({"kind": "exiting"})
        self.sessions.close()
        for agent in self._agents:
            agent.close()
        self._drop_snapshots()
        _attach_records.remove_rank(self.folder, self.rank, self._pid)

    # ------------------------------------------------------------------ requests

    def _handlers(self) -> dict[str, _agent.Handler]:
        sessioned: dict[str, Callable[[dict[str, Any]], Any]] = {
            "pause": lambda r: self.pause.request(_step_or_next(r.get("step"))),
            "wait_paused": lambda r: {"paused": self.pause.wait_paused(float(r["timeout"]))},
            "resume": lambda r: self.pause.resume() or {"ok": True},
            "run": self._run,
            "pull": self._pull,
            "push": self._push,
            "call": self._call,
        }
        handlers: dict[str, _agent.Handler] = {
            name: self._with_session(function) for name, function in sessioned.items()
        }
        handlers.update(
            session=self._open_session,
            detach=self._detach,
            status=lambda r, c: {"state": self.state()},
            stacks=self._diagnostics,
            trace=self._diagnostics,
            # A pool's kernel keeps these links; here a fault link would install a handler
            # of the job's SIGUSR1, and a plain connection to --listen may ask for one.
            fault_link=_no_link,
            event_link=_no_link,
        )
        return handlers

    def _with_session(self, function: Callable[[dict[str, Any]], Any]) -> _agent.Handler:
        def handler(request: dict[str, Any], conn: Connection) -> Any:
            self.sessions.check(request)
            return function(request)

        return handler

    def state(self) -> Any:
        """This rank's :class:`pool.common._job_status.RankState`."""
        point = self.boundary.stopped if self.pause.paused_step is not None else None
        return _job_phase.rank_state(
            self.rank,
            self.training_thread,
            step=self.boundary.count,
            paused=point is not None,
            paused_frame=point.frame if point is not None else None,
            pause_target=self.boundary.target,
            code_name=code_name,
        )

    def _diagnostics(self, request: dict[str, Any], conn: Connection) -> Any:
        _job_phase.ready_recorder()
        return self._agents[0].answer(request.get("op"), request)

    def _open_session(self, request: dict[str, Any], conn: Connection) -> Any:
        refused = self.sessions.open(request, conn)
        if refused is not None:
            return refused
        self.pause.adopted()
        self._use_snapshot_key(request.get("snapshot_key"))
        # What the job's code publishes (a snapshot's record) goes to the notebook.
        _notices.set_sink(lambda notice: self.sessions.notify({"kind": "notice", "notice": notice}))
        _job_phase.ready_recorder()
        conn.send({"ok": True, "state": self.state()})
        return _agent.KEPT

    def _detach(self, request: dict[str, Any], conn: Connection) -> Any:
        session = self.sessions.check(request)
        self._detached()
        self.sessions.end(session)
        return {"ok": True}

    def _detached(self) -> None:
        """The notebook detached: no pause stays, its snapshots go, the environment is
        the job's again."""
        self.pause.cancel()
        _notices.set_sink(None)
        self._drop_snapshots()

    # ------------------------------------------------------------------ in the training thread

    def _run(self, request: dict[str, Any]) -> Any:
        code, cell = str(request["code"]), int(request.get("cell") or 0)
        return self.pause.submit(lambda ns: run_cell(code, cell, ns), _timeout(request))

    def _pull(self, request: dict[str, Any]) -> Any:
        name = str(request["name"])

        def pull(namespace: CellNamespace) -> Any:
            try:
                value = namespace.lookup(name)
            except KeyError:
                raise NameError(f"name {name!r} is not defined") from None
            return _results.to_kernel(value, name)

        return {"value": self.pause.submit(pull, _timeout(request))}

    def _push(self, request: dict[str, Any]) -> Any:
        values = dict(request["values"])
        self.pause.submit(lambda ns: ns.defined.update(values), _timeout(request))
        return {"ok": True}

    def _call(self, request: dict[str, Any]) -> Any:
        function, args = request["function"], tuple(request.get("args") or ())
        kwargs = dict(request.get("kwargs") or {})
        value = self.pause.submit(
            lambda ns: _results.call(function, *args, **kwargs), _timeout(request)
        )
        return {"value": value}

    # ------------------------------------------------------------------ snapshots

    def _use_snapshot_key(self, key: Any) -> None:
        """Snapshots taken while attached: the job's root in host memory and the notebook's
        key, unless the job chose its own root."""
        if not isinstance(key, str) or self._snapshot_env is not None:
            return
        if os.environ.get(_snapshot_root.ENV_VAR):
            return  # the job's own: left as it is
        digest = hashlib.sha256(os.fsencode(self.folder)).hexdigest()[:12]
        base = _snapshot_root.SHARED_MEMORY
        root = os.path.join(base if os.path.isdir(base) else self.folder, f"fsdpi-{digest}")
        self._snapshot_env = {
            name: os.environ.get(name)
            for name in (_snapshot_root.ENV_VAR, _snapshot_root.KEY_ENV_VAR)
        }
        os.environ[_snapshot_root.ENV_VAR] = root
        os.environ[_snapshot_root.KEY_ENV_VAR] = key

    def _drop_snapshots(self) -> None:
        saved, self._snapshot_env = self._snapshot_env, None
        if saved is None:
            return
        root = os.environ.get(_snapshot_root.ENV_VAR)
        with contextlib.suppress(OSError, ValueError):
            _snapshot_root.remove_root(root)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _no_link(request: dict[str, Any], conn: Connection) -> dict[str, Any]:
    return {
        "error": f"an attachable job keeps no {request.get('op')} (it installs no signal "
        "handler); ask for status, stacks or trace"
    }


def _step_or_next(value: Any) -> int | None:
    """A pause request's step (``None``: the rank's next one)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"step must be an optimizer step number >= 1, got {value!r}")
    return value


def _timeout(request: dict[str, Any]) -> float | None:
    value = request.get("timeout")
    return None if value is None else float(value)


_SERVICE: AttachService | None = None
_LOCK = threading.Lock()


def start(options: AttachOptions, training_thread: int | None = None) -> AttachService:
    """Make this process attachable (once: a second call returns the running service)."""
    global _SERVICE
    with _LOCK:
        if _SERVICE is None:
            service = AttachService(
                options, threading.get_ident() if training_thread is None else training_thread
            )
            service.start()
            _SERVICE = service
        return _SERVICE


def current() -> AttachService | None:
    return _SERVICE


def stop() -> None:
    """Stop this process's service (tests; a process's exit does it by itself)."""
    global _SERVICE
    with _LOCK:
        if _SERVICE is not None:
            _SERVICE.close()
            _SERVICE = None
