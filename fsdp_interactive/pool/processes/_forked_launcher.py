"""ipyparallel engine launchers whose engines are forked from a process that has torch.

:class:`ForkedEngineSetLauncher` is a drop-in for ipyparallel's ``LocalEngineSetLauncher``
(``Cluster(engine_launcher_class=ForkedEngineSetLauncher)``, given ``forker=``): same
engine command, log files, signals and stop sequence, but each engine is forked by one
:mod:`._engine_forker` process instead of being started from scratch. Importing torch
(seconds of CPU per process) then happens once, while the controller starts, instead of
once per engine after it.

Contract, as for ipyparallel's local launchers:

* every engine runs in its own session, with its output in its own log file;
* ``pid``, ``signal``, ``stop`` and ``join`` work on the engine process itself;
* ``stop_data["exit_code"]`` is the engine's exit status as ``subprocess`` reports it
  (negative: killed by that signal), reported by the forker, which is the engines'
  parent. Should the forker itself die, engines still running are watched through
  their pids instead and their exit codes are then unknown (``None``);
* stopping the set stops its engines; the forker is ended by whoever started it
  (:meth:`EngineForker.close`, which also ends what it forked and removes its snapshot
  root);
* ``start_replacement(identifier)`` forks one engine more, in place of one that ended or
  never registered (a start retries such an engine once: :mod:`pool._registration`).

:class:`EngineForker` is the kernel's handle on a forker on this host or, given an ssh
command, on another (:mod:`._ssh_forked_launcher`). Linux only (``os.fork`` and ``os.pidfd_open``); :func:`forking_supported` says whether
this interpreter can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Dict, Instance, Unicode

from fsdp_interactive import _private_files
from fsdp_interactive.pool.common import _py_spy
from fsdp_interactive.pool.processes._forker_setup import ForkerSetup

log = logging.getLogger(__name__)

_FORKER_MODULE = "fsdp_interactive.pool.processes._engine_forker"
#: What a replacement engine's identifier adds to the one it replaces ("3" -> "3-retry").
REPLACEMENT_SUFFIX = "-retry"
_STOP_WAIT_S = 5.0


def forking_supported() -> bool:
    """Whether engines can be forked here (Linux, with ``os.fork`` and ``os.pidfd_open``)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


class ForkerError(RuntimeError):
    """The forker could not start an engine (or is gone); the message says why."""


def forker_command(python: str = sys.executable) -> list[str]:
    """The command that runs an engine forker with ``python`` (see :mod:`._engine_forker`);
    its setup, the pool's snapshot root among it, goes to its stdin, never on it."""
    return [python, "-m", _FORKER_MODULE]


class EngineForker:
    """The notebook side's handle on one running :mod:`._engine_forker` process.

    ``command`` starts it (default: this Python, on this host; an ``ssh`` command runs it
    on another host, its stdin and stdout then the channel); its stderr is appended to
    ``log_path``. ``setup`` is the first line it is sent (the pool's snapshot root on its
    host: :mod:`._forker_setup`). ``where`` names its host in messages (``None``: this
    host). ``fork`` is awaited on an asyncio loop; exit events arrive on a reader thread
    and are handed to the callbacks registered with ``on_exit`` (called on that thread).
    """

    def __init__(
        self,
        log_path: str,
        env: dict[str, str],
        *,
        command: list[str] | None = None,
        where: str | None = None,
        setup: ForkerSetup | None = None,
    ):
        self.log_path = log_path
        self.where = where
        self.command = list(command) if command else forker_command()
        self.setup = setup or ForkerSetup()
        with os.fdopen(_private_files.open_log(log_path), "ab") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        #: What the forker said of the snapshot root once ready ("created", "adopted" or
        #: None), and why it refused it (None: it did not).
        self.root_made: str | None = None
        self.root_refused: str | None = None
        self.began = time.monotonic()
        #: Set once the forker has imported what it preloads (``ready_s``: seconds it took).
        self.ready = threading.Event()
        self.ready_s: float | None = None
        #: The forker's own pid on its host (the local pid is that of ``command``).
        self.remote_pid: int | None = None
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._tokens = itertools.count()
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._on_exit: dict[int, Callable[[int | None], None]] = {}
        self._exited: dict[int, int] = {}
        self._outputs: dict[int, str] = {}
        #: Import specs the forker imported for later children (see :meth:`warm`), and
        #: those it skipped, with the reason.
        self.warmed: set[str] = set()
        self.warm_skipped: dict[str, str] = {}
        self._warm_settled = threading.Condition(self._lock)
        self._gone = False
        self._send(self.setup.line().decode().rstrip("\n"))
        self._reader = threading.Thread(target=self._read, name="engine-forker-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The pid of the process started here (the forker, or the ssh client to it)."""
        return self._proc.pid

    def running(self) -> bool:
        return self._proc.poll() is None and not self._gone

    def exit_status(self) -> int | None:
        """How the process started here ended, as ``subprocess`` reports it (negative:
        killed by that signal); ``None`` while it runs."""
        return self._proc.poll()

    async def fork(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        output: str,
        *,
        nanny: bool = False,
        extend_env: bool = False,
        collect_output: bool = False,
    ) -> int:
        """Start ``argv`` (``[python, "-m", module, ...]``) as a forked child; its pid.

        ``nanny``: the child is an ipyparallel engine; fork its nanny with it (see
        :mod:`._forked_nanny`). ``extend_env``: ``env`` updates the forker's own
        environment instead of replacing it; ``cwd=None``: the forker's working directory.
        ``collect_output``: the child's output comes back with its exit (:meth:`take_output`)
        and its file is removed.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        token = str(next(self._tokens))
        with self._lock:
            if self._gone:
                raise ForkerError(self._gone_message())
            self._pending[token] = (loop, future)
        request: dict[str, Any] = {
            "token": token,
            "argv": argv,
            "env": env,
            "cwd": cwd,
            "output": output,
        }
        for flag, value in (
            ("nanny", nanny),
            ("extend_env", extend_env),
            ("collect_output", collect_output),
        ):
            if value:
                request[flag] = True
        line = json.dumps(request)
        # A full pipe (the forker is still importing) must not block the event loop.
        await loop.run_in_executor(None, self._send, line)
        return await future

    def signal(self, pid: int, sig: int) -> None:
        """Have the forker send ``sig`` to its child ``pid`` (ignored once that child was
        reaped, so a reused pid is never hit); no answer is awaited."""
        self._send(json.dumps({"signal": int(sig), "pid": int(pid)}))

    def warm(self, specs: list[str]) -> None:
        """Have the forker import ``specs`` (see :mod:`._warm_imports`) for the children it
        forks later; no answer is awaited (:meth:`wait_warm` waits for it)."""
        if specs:
            self._send(json.dumps({"warm": list(specs)}))

    def precheck(self, snapshot_id: str) -> None:
        """Have the forker hash its host's copy of the snapshot ``snapshot_id`` ahead of a
        restore (:mod:`fsdp_interactive.checkpoint._format._prechecked`); no answer is awaited."""
        self._send(json.dumps({"precheck": snapshot_id}))

    def wait_warm(self, specs: list[str], timeout: float) -> bool:
        """Wait until the forker warmed or skipped each of ``specs``; whether it did in
        ``timeout`` seconds (``False`` at once once the forker is gone)."""
        with self._warm_settled:
            return (
                self._warm_settled.wait_for(
                    lambda: (
                        self._gone or all(s in self.warmed or s in self.warm_skipped for s in specs)
                    ),
                    timeout,
                )
                and not self._gone
            )

    def on_exit(self, pid: int, callback: Callable[[int | None], None]) -> None:
        """Call ``callback(exit_code)`` once child ``pid`` has ended (at once if it has).

        ``exit_code`` is ``None`` when the forker ended before the child did.
        """
        with self._lock:
            if pid in self._exited:
                code: int | None = self._exited.pop(pid)
            elif self._gone:
                code = None
            else:
                self._on_exit[pid] = callback
                return
        callback(code)

    def take_output(self, pid: int) -> str | None:
        """The output child ``pid`` left (forked with ``collect_output``), once it ended."""
        with self._lock:
            return self._outputs.pop(pid, None)

    def begin_close(self) -> None:
        """Ask the forker to end (its stdin closes): it ends the children still running,
        removes its snapshot root and exits. :meth:`close` waits for that."""
        with self._write_lock, contextlib.suppress(OSError):
            self._proc.stdin.close()

    def close(self, timeout: float = _STOP_WAIT_S) -> None:
        """End the forker through its handle: close its stdin, then kill it if it lingers."""
        self.begin_close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout)
        self._reader.join(timeout)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the forker's log (its stderr, and ssh's)."""
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def _send(self, line: str) -> None:
        try:
            with self._write_lock:
                self._proc.stdin.write((line + "\n").encode())
                self._proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the reader reports the forker's end to every pending request

    def _read(self) -> None:
        for raw in self._proc.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            if message.get("ready"):
                self.remote_pid = message.get("pid")
                self.root_made = message.get("snapshot_root")
                self.root_refused = message.get("snapshot_root_error")
                self.ready_s = time.monotonic() - self.began
                self.ready.set()
                continue
            if "warmed" in message:
                self._warm_done(message)
                continue
            if "exited" in message:
                output = message.get("output")
                self._child_exited(
                    int(message["exited"]),
                    int(message["exit_code"]),
                    output if isinstance(output, str) else None,
                )
                continue
            with self._lock:
                waiting = self._pending.pop(str(message.get("token")), None)
            if waiting is None:
                continue
            loop, future = waiting
            if "pid" in message:
                result: Any = int(message["pid"])
                loop.call_soon_threadsafe(_resolve, future, result, None)
            else:
                error = ForkerError(f"the engine forker refused a request: {message.get('error')}")
                loop.call_soon_threadsafe(_resolve, future, None, error)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(1.0)  # its status, for the messages
        with self._lock:
            self._gone = True
            self._warm_settled.notify_all()
            pending, self._pending = self._pending, {}
            orphans, self._on_exit = self._on_exit, {}
        for loop, future in pending.values():
            loop.call_soon_threadsafe(_resolve, future, None, ForkerError(self._gone_message()))
        for callback in orphans.values():
            callback(None)

    def _warm_done(self, message: dict[str, Any]) -> None:
        warmed, skipped = message.get("warmed"), message.get("skipped")
        with self._warm_settled:
            self.warmed.update(s for s in warmed or () if isinstance(s, str))
            if isinstance(skipped, dict):
                self.warm_skipped.update({str(k): str(v) for k, v in skipped.items()})
            self._warm_settled.notify_all()
        if warmed or skipped or message.get("error"):
            log.info(
                "engine forker %s warmed %s; skipped %s %s",
                self.where or "on this host",
                warmed,
                skipped,
                message.get("error") or "",
            )

    def _child_exited(self, pid: int, code: int, output: str | None) -> None:
        with self._lock:
            if output is not None:
                self._outputs[pid] = output
            callback = self._on_exit.pop(pid, None)
            if callback is None:
                self._exited[pid] = code
        if callback is not None:
            callback(code)

    def _gone_message(self) -> str:
        status = self._proc.poll()
        which = f"on {self.where} (ssh pid {self.pid})" if self.where else f"(pid {self.pid})"
        return f"the engine forker {which} ended with status {status}:\n{self.log_tail()}"


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine forked by the set's forker; otherwise ipyparallel's local engine launcher."""

    _exited_event: threading.Event | None = None

    async def start_forked(self, forker: EngineForker) -> int:
        """Fork this engine; its pid. Its exit is reported through ``notify_stop``."""
        if self.state != "before":
            raise RuntimeError(f"engine {self.identifier} was already started ({self.state})")
        env = os.environ.copy()
        env.update(self.get_env())
        env[_py_spy.TRACER_ENV] = str(os.getpid())  # this kernel may read its stack
        self.loop  # noqa: B018 - bind the launcher's IOLoop on this (the loop's) thread
        self._exited_event = threading.Event()
        try:
            pid = await forker.fork(
                list(self.args), env, os.path.abspath(self.work_dir), self.output_file, nanny=True
            )
        except BaseException:
            self._exited_event = None  # never started: nothing to wait for
            raise
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        forker.on_exit(pid, self._exited)
        return pid

    def _exited(self, exit_code: int | None) -> None:
        if exit_code is None and self.process is not None:
            # The forker is gone before this engine: watch the pid like ipyparallel does.
            self._start_waiting()
            return
        stop_data = {"exit_code": exit_code, "pid": self.pid, "identifier": self.identifier}
        self.loop.add_callback(lambda: self.notify_stop(stop_data))
        assert self._exited_event is not None
        self._exited_event.set()

    async def join(self, timeout: float | None = None) -> None:
        """Wait for the engine to exit; ``TimeoutError`` after ``timeout`` seconds."""
        event = self._exited_event
        if event is None or self._wait_thread is not None:
            await super().join(timeout)
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not event.is_set():
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(f"Process {self.pid} did not exit in {timeout} seconds.")
            await asyncio.sleep(0.02)


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, with engines forked from one warmed-up process.

    ``forker``: the running :class:`EngineForker` to fork from. Whoever passes it keeps
    and ends it (the pool keeps one across restarts); stopping the set stops its engines
    only.
    """

    launcher_class = ForkedEngineLauncher
    forker = Instance(EngineForker, allow_none=True)
    #: Where the engines' logs go ("": the profile's ``log`` folder).
    log_dir = Unicode("")
    #: Every engine launcher this set made, by identifier, ended ones too (``launchers``
    #: forgets an engine as it ends, possibly before anyone looked at it).
    made = Dict()

    @property
    def forker_pid(self) -> int | None:
        return self.forker.pid if self.forker is not None else None

    async def start(self, n: int) -> list[int]:  # type: ignore[override]
        """Start ``n`` engines; their pids."""
        self._check_forker()
        self.n = n
        engines = [self._new_launcher(str(i)) for i in range(n)]
        pids = list(await asyncio.gather(*(e.start_forked(self.forker) for e in engines)))
        self.notify_start(pids)
        return pids

    async def start_replacement(self, identifier: str) -> tuple[str, int]:
        """Fork one more engine in place of engine ``identifier`` (one that ended, or that
        the caller gave up on and ends itself); ``(its identifier, its pid)``."""
        self._check_forker()
        engine = self._new_launcher(f"{identifier}{REPLACEMENT_SUFFIX}")
        return engine.identifier, await engine.start_forked(self.forker)

    def _check_forker(self) -> None:
        if self.forker is None or not self.forker.running():
            raise ForkerError("ForkedEngineSetLauncher needs forker=<a running EngineForker>")

    def _new_launcher(self, identifier: str) -> ForkedEngineLauncher:
        log_dir = self.log_dir or os.path.join(self.profile_dir, "log")
        os.makedirs(log_dir, exist_ok=True)
        engine = self.launchers[identifier] = self.launcher_class(
            work_dir=self.work_dir,
            parent=self,
            log=self.log,
            profile_dir=self.profile_dir,
            cluster_id=self.cluster_id,
            environment=self.environment,
            identifier=identifier,
            output_file=os.path.join(
                log_dir, f"ipengine-{self.cluster_id}-{self.engine_set_id}-{identifier}.log"
            ),
        )
        engine.engine_cmd = copy.deepcopy(self.engine_cmd)
        engine.engine_args = copy.deepcopy(self.engine_args)
        engine.on_stop(self._notice_engine_stopped)
        self.made[identifier] = engine
        return engine
