"""Rank side: one run of an unmodified torchrun script on a pool's rank, able to pause at an
optimizer step and go on.

The kernel (:mod:`fsdp_interactive.pool._script_calls`) sends every targeted rank the
same call in one notebook call: :func:`start` (``%fsdp run``) or :func:`resume`
(``%fsdp continue``), run in the engine's namespace. The script runs as ``__main__`` on a
thread of its own, in the world torchrun would give it (:mod:`._torchrun_world`), while
the engine's main thread waits for it to pause or end; then the names it built are bound
in the namespace (:mod:`._script_kept`) and the call returns, so that the cells after it,
the views, snapshots and checkpoints see them while the script's frames stay alive.

**Pausing.** A global optimizer step hook (``torch.optim.optimizer.
register_optimizer_step_post_hook``: every ``torch.optim.Optimizer``, also under
accelerate, the HF Trainer or Lightning) counts the steps the script's thread takes with
its first optimizer. After each, when ``stop_at`` is reached or an interrupt asked for a
pause, the script's thread blocks there until :func:`resume`. Ranks must pause after the
same step, or one would wait in the next step's collectives for a peer that paused: with
every rank targeted, they agree after each step with one all-reduce of a flag on a gloo
group of their own (a few tens of microseconds; nothing of the model is touched). A run on
part of the ranks pauses each rank on its own.

**Interrupts.** The first SIGINT while the script runs asks for a pause after the next
step; the second raises ``KeyboardInterrupt`` inside the script's thread, which ends it
as an interrupt ends a cell (a thread blocked in C sees it when it returns to Python).

**Ends.** A script that returns (or calls ``sys.exit(0)``) ends the run; one that raises
fails the call with its own exception and traceback (the runner's frames hidden), kept
for ``%fsdp debug``. In every case the world is undone and what the script built stays.
:func:`resume` with ``stop`` ends a paused run: :class:`ScriptStopped` is raised at the
pause, so the script's ``finally`` blocks run.

Faults: the run lives in this process; a rank that dies takes its run with it (the
kernel's journal replays the run to its pause when a recovery needs it). Only one run
exists per rank; a new one is refused while another is paused.
"""

from __future__ import annotations

import builtins
import ctypes
import linecache
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

from fsdp_interactive.pool.rank import _agent
from fsdp_interactive.pool.rank._script_kept import (
    RETURN_HOOK,
    KeptCalls,
    built_names,
    compile_script,
    is_definition,
    script_frames,
    summary,
    traceback_frames,
)
from fsdp_interactive.pool.rank._torchrun_world import Place, ScriptWorld

log = logging.getLogger(__name__)

#: States of a run.
RUNNING, PAUSED, ENDED, FAILED, STOPPED, INTERRUPTED = (
    "running",
    "paused",
    "ended",
    "failed",
    "stopped",
    "interrupted",
)
_POLL_S = 0.05


class ScriptStopped(BaseException):
    """Raised at the pause of a script that is told to stop (``%fsdp continue --stop``);
    a ``BaseException``, so that the script's ``except Exception`` does not swallow it."""


class ScriptRun:
    """One run of a script on this rank (module docstring). ``spec``: what the kernel
    sends (``path``, ``source``, ``args``, ``cwd``, ``stop_at``, ``agree``, ``place``)."""

    def __init__(
        self,
        spec: Mapping[str, Any],
        place: Place,
        namespace: MutableMapping[str, Any],
        *,
        set_environment: bool = True,
    ) -> None:
        self.path = str(spec["path"])
        self.namespace = namespace
        self.name = os.path.basename(self.path)
        self.source = str(spec["source"])
        self.stop_at: int | None = checked_stop_at(spec.get("stop_at"))
        self.agree = bool(spec.get("agree", True))
        self.code = compile_script(self.source, self.path)
        self.world = ScriptWorld(
            self.path,
            list(spec.get("args") or []),
            str(spec["cwd"]),
            place,
            set_environment=set_environment,
        )
        self.kept = KeptCalls(self.code)
        self.module = types.ModuleType("__main__")
        self.module.__dict__.update(
            __file__=self.path,
            __builtins__=builtins,
            __spec__=None,
            __loader__=None,
            __package__=None,
            __cached__=None,
            **{RETURN_HOOK: self.kept.hook},
        )
        self.state = "new"
        self.steps = 0
        self.paused_by: str | None = None
        self.error: BaseException | None = None
        self.bound: dict[str, int] = {}
        self.replaced: list[str] = []
        self._changed = threading.Event()
        self._resume = threading.Event()
        self._pause_asked = False
        self._stop_asked = False
        self._thread: threading.Thread | None = None
        self._first_optimizer: weakref.ref[Any] | None = None
        self._hook: Any = None
        self._group: Any = None
        self._main_module: Any = None

    # ------------------------------------------------------------------ main thread

    def begin(self) -> None:
        """Start the script's thread and wait for its first pause or its end."""
        __tracebackhide__ = True
        if self.agree:
            from fsdp_interactive._background_groups import background_gloo_group

            self._group = background_gloo_group("script pauses")  # collective, once
        linecache.cache[self.path] = (
            len(self.source),
            None,
            self.source.splitlines(True),
            self.path,
        )
        self.world.enter()
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook = register_optimizer_step_post_hook(self._after_step)
        self._thread = threading.Thread(target=self._main, name=f"script {self.name}", daemon=True)
        self.state = RUNNING
        self._enter_main_module()
        self._thread.start()
        self._point_agent_at(self._thread.ident)
        self._wait()

    def go_on(self, stop_at: int | None, stop: bool) -> None:
        """Resume a paused run, to pause again after step ``stop_at`` (``None``: at the end
        or at an interrupt); ``stop``: end it at the pause instead."""
        __tracebackhide__ = True
        self.stop_at = stop_at
        self._stop_asked = stop
        self._changed.clear()
        self.state = RUNNING
        self._enter_main_module()
        self._point_agent_at(self._thread.ident if self._thread is not None else None)
        self._resume.set()
        self._wait()

    def _enter_main_module(self) -> None:
        """While the script's thread runs, the script is ``__main__`` (what pickles its
        classes by reference finds them there)."""
        self._main_module = sys.modules.get("__main__")
        sys.modules["__main__"] = self.module

    @staticmethod
    def _point_agent_at(ident: int | None) -> None:
        """The rank's user thread, whose stack hang reports and ``stacks()`` show first:
        the script's while it runs, the engine's main thread otherwise."""
        agent = _agent.current()
        if agent is not None and ident is not None:
            agent.user_thread = ident

    def _settled(self) -> None:
        if self._main_module is not None:
            sys.modules["__main__"] = self._main_module
            self._main_module = None
        self._point_agent_at(threading.get_ident())

    def _wait(self) -> None:
        __tracebackhide__ = True
        interrupted = False
        while True:
            try:
                while not self._changed.wait(_POLL_S):
                    pass
                break
            except KeyboardInterrupt:
                if not interrupted:  # the kernel says what happens
                    interrupted = True
                    self._pause_asked = True
                else:
                    self._raise_in_script(KeyboardInterrupt)
        self._changed.clear()
        self._settled()
        self._bind()
        if self.state == PAUSED:
            return
        self._finish()
        error = self.error
        if error is not None and self.state in (FAILED, INTERRUPTED):
            raise error.with_traceback(_from_script(error.__traceback__, self.path))

    def _raise_in_script(self, kind: type[BaseException]) -> None:
        ident = self._thread.ident if self._thread is not None else None
        if ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(kind)
            )

    def _finish(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.world.leave()
        self._group = None
        self.kept.calls = []

    def _bind(self) -> None:
        """Bind what the script built in the engine's namespace; note the names whose
        earlier value (a cell's) it replaced."""
        namespace = self.namespace
        calls = None
        if self.state == PAUSED and self._thread is not None:
            frames = script_frames(sys._current_frames().get(self._thread.ident), self.path)
        elif self.error is not None:
            frames = traceback_frames(self.error.__traceback__, self.path)
        else:
            frames, calls = [], self.kept.calls
        names = built_names(self.module.__dict__, frames, calls)
        for name, value in names.items():
            if name in namespace:
                held = namespace[name]
                a_runs = _BOUND_BY_RUNS.get(name) == id(held)
                if not a_runs and not _same(held, value) and name not in self.replaced:
                    self.replaced.append(name)
            namespace[name] = value
            self.bound[name] = _BOUND_BY_RUNS[name] = id(value)

    # ------------------------------------------------------------------ script's thread

    def _main(self) -> None:
        self.world.pin_thread_device()
        state = ENDED
        try:
            exec(self.code, self.module.__dict__)
        except SystemExit as exit_:
            if exit_.code not in (None, 0):
                self.error, state = exit_, FAILED
        except ScriptStopped:
            state = STOPPED
        except KeyboardInterrupt as error:
            self.error, state = error, INTERRUPTED
        except BaseException as error:
            self.error, state = error, FAILED
        finally:
            self.state = state
            log.debug("script %s %s after %d steps", self.name, state, self.steps)
            self._changed.set()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The global optimizer step hook: count the script's steps; pause where asked."""
        if self._thread is None or threading.get_ident() != self._thread.ident:
            return  # a cell's own optimizer step while the script is paused
        first = self._first_optimizer() if self._first_optimizer is not None else None
        if first is None:
            self._first_optimizer = weakref.ref(optimizer)
        elif first is not optimizer:
            return
        self.steps += 1
        reached = self.stop_at is not None and self.steps >= self.stop_at
        pause = reached or self._pause_asked
        if self._group is not None:
            pause = self._agreed(pause)
        if pause:
            self._pause("stop-at" if reached else "interrupt")

    def _agreed(self, pause: bool) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if pause else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def _pause(self, why: str) -> None:
        self.paused_by = why
        self._pause_asked = False
        self.state = PAUSED
        self._changed.set()
        self._resume.wait()
        self._resume.clear()
        if self._stop_asked:
            raise ScriptStopped(f"{self.name} was stopped at its pause after step {self.steps}")

    # ------------------------------------------------------------------ report

    def status(self) -> dict[str, Any]:
        """Plain data for the kernel: state, steps, what it kept (this rank's values)."""
        listed, definitions = [], 0
        for name in self.bound:
            if name not in self.namespace:
                continue
            value = self.namespace[name]
            if is_definition(value):
                definitions += 1
            else:
                listed.append((name, summary(value)))
        error = None
        if self.error is not None and self.state in (FAILED, INTERRUPTED):
            error = f"{type(self.error).__name__}: {self.error}"
        return {
            "script": self.path,
            "state": self.state,
            "steps": self.steps,
            "stop_at": self.stop_at,
            "paused_by": self.paused_by if self.state == PAUSED else None,
            "kept": listed,
            "definitions": definitions,
            "replaced": list(self.replaced),
            "error": error,
        }


# ---------------------------------------------------------------------------- entry points

_RUN: ScriptRun | None = None
#: The object each name held when a script run last bound it (any run on this rank): a run
#: that replaces a name an earlier run left says nothing; one that replaces a cell's says so.
_BOUND_BY_RUNS: dict[str, int] = {}


def start(
    namespace: MutableMapping[str, Any],
    spec: Mapping[str, Any],
    *,
    place: Place | None = None,
    set_environment: bool = True,
) -> None:
    """``%fsdp run``: start the script of ``spec`` on this rank and wait for its first
    pause or its end (module docstring). Refused while another run is paused here.

    ``place``: where this rank stands (default: the pool's rank, from the group it joined);
    ``set_environment``: set torchrun's variables (an exported job runs under torchrun and
    has them already)."""
    __tracebackhide__ = True
    global _RUN
    if _RUN is not None and _RUN.state == PAUSED:
        raise RuntimeError(
            f"{_RUN.name} is paused after step {_RUN.steps} on this rank; continue or stop "
            "it before running another script"
        )
    run = ScriptRun(spec, place or _place(spec), namespace, set_environment=set_environment)
    _RUN = run
    run.begin()


#: Specs sent ahead of the call that starts their run (:func:`receive`), by key.
_RECEIVED: dict[str, dict[str, Any]] = {}


def receive(key: str, spec: Mapping[str, Any]) -> None:
    """Keep ``spec`` (the script's source and where it runs) for :func:`start_received`: the
    call that starts a run then stays one short line in tracebacks and stacks."""
    _RECEIVED.clear()
    _RECEIVED[key] = dict(spec)


def start_received(namespace: MutableMapping[str, Any], key: str) -> None:
    """:func:`start` with the spec :func:`receive` kept under ``key``."""
    __tracebackhide__ = True
    spec = _RECEIVED.pop(key, None)
    if spec is None:
        raise RuntimeError(f"no script run {key!r} was sent to this rank")
    start(namespace, spec)


def resume(namespace: MutableMapping[str, Any], spec: Mapping[str, Any]) -> None:
    """``%fsdp continue``: resume the paused run (``spec``: ``stop_at``, ``stop``)."""
    __tracebackhide__ = True
    run = _RUN
    if run is None or run.state != PAUSED:
        raise RuntimeError("no script run is paused on this rank")
    stop_at = checked_stop_at(spec.get("stop_at"))
    if stop_at is not None and stop_at <= run.steps:
        raise ValueError(
            f"stop_at={stop_at}: {run.name} has already taken {run.steps} steps; give a later step"
        )
    run.namespace = namespace
    run.go_on(stop_at, bool(spec.get("stop")))


def current() -> ScriptRun | None:
    """The current or last run on this rank."""
    return _RUN


def status() -> dict[str, Any] | None:
    """The current or last run's status on this rank (``None``: no run yet)."""
    return _RUN.status() if _RUN is not None else None


def _place(spec: Mapping[str, Any]) -> Place:
    from fsdp_interactive.pool.rank._bootstrap import rank_context

    rank, world_size, local_rank, device = rank_context()
    places = spec.get("place") or {}
    hosts = places.get("group_ranks") or {}
    import torch.distributed as dist

    return Place(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        group_rank=int(hosts.get(str(rank), hosts.get(rank, 0))),
        group_world_size=int(places.get("group_world_size", 1)),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=str(places.get("master_port") or os.environ.get("MASTER_PORT") or 29500),
        run_id=str(places.get("run_id", "fsdp-interactive")),
        device=device,
        backend=str(dist.get_backend()),
    )


def checked_stop_at(value: Any) -> int | None:
    """``value`` as a step to pause after (``None``: none); ``ValueError`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"stop_at must be a step number >= 1 or None, got {value!r}")
    return value


def _same(held: Any, value: Any) -> bool:
    """The same object, or an equal simple value (a rank number, a device)."""
    if held is value:
        return True
    simple = (bool, int, float, str, bytes, type(None))
    torch = sys.modules.get("torch")
    if torch is not None:
        simple += (torch.device, torch.dtype)
    if type(held) is type(value) and isinstance(value, simple):
        return bool(held == value)
    return False


def _from_script(tb: types.TracebackType | None, path: str) -> types.TracebackType | None:
    """The traceback from the script's first frame on (the runner's frames dropped)."""
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename != path:
        start = start.tb_next
    return start if start is not None else tb
