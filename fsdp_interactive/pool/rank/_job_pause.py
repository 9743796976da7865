"""Rank side: a job paused at a step boundary, serving the notebook in its training thread.

The notebook asks every rank to pause after the same optimizer step (it chooses the
step: :mod:`fsdp_interactive.pool._attached_job`); :meth:`JobPause.request` arms the
rank's :class:`._step_boundary.StepBoundary` for it. When the training thread completes
that step it stays in :meth:`JobPause._serve`, inside ``optimizer.step()``'s post-hook,
and runs what the notebook sends (:meth:`JobPause.submit`: a cell, a pull, a call), one
item at a time, in the training thread, where the job's model and process group live,
until :meth:`JobPause.resume`. Then ``optimizer.step()`` returns and the job goes on as if
nothing happened (what cells did to its objects aside).

Faults: a notebook that goes away (:meth:`JobPause.orphaned`) leaves a deadline: a
paused rank, or one that reaches its pause step later, waits up to the job's
``pause_timeout`` for a notebook to attach again, then resumes by itself; never longer.
A rank of the job that dies while the others are paused leaves them paused (no
collective is in flight at a boundary); the notebook sees it and says so, and the job's
own failure handling (torchrun's, SLURM's) runs as without a notebook once they resume.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.pool.rank._paused_cells import CellNamespace
from fsdp_interactive.pool.rank._step_boundary import StepBoundary, StopPoint

log = logging.getLogger(__name__)

#: How often a paused training thread looks at its deadline.
_POLL_S = 0.1


class NotPaused(RuntimeError):
    """Work that needs a paused rank was sent to a running one."""


@dataclass
class _Work:
    function: Callable[[CellNamespace], Any]
    done: threading.Event
    result: Any = None
    error: BaseException | None = None


_RESUME = object()


class JobPause:
    """This rank's pause (see the module); ``pause_timeout``: seconds a pause outlives the
    notebook that asked for it."""

    def __init__(self, boundary: StepBoundary, pause_timeout: float) -> None:
        self.boundary = boundary
        self.pause_timeout = float(pause_timeout)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._paused = threading.Event()
        self._point: StopPoint | None = None
        self._namespace: CellNamespace | None = None
        self._deadline: float | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ asked by the notebook

    @property
    def paused_step(self) -> int | None:
        """The step this rank is paused after, else ``None``."""
        point = self._point
        return point.step if point is not None and self._paused.is_set() else None

    def request(self, step: int | None) -> dict[str, Any]:
        """Pause after optimizer step ``step`` (``None``: the next one); ``{"count",
        "target", "paused"}``: the steps this rank had completed when the request was set,
        the step it will pause after, and the step it is paused after (``None``: running).
        A rank paused at another step goes on to ``target``."""
        with self._lock:
            self._deadline = None
            count = self.boundary.stop_at(step, self._serve)
            target = self.boundary.target
            paused = self.paused_step
            if paused is not None and paused != target:
                self._queue.put(_RESUME)
                paused = None
        log.debug("pause requested after step %s (at step %d)", target, count)
        return {"count": count, "target": target, "paused": paused}

    def wait_paused(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the pause; the step paused after, or ``None``."""
        self._paused.wait(timeout)
        return self.paused_step

    def cancel(self) -> None:
        """Withdraw the pause: a paused rank resumes, a running one will not pause."""
        with self._lock:
            self._deadline = None
            self.boundary.cancel()
            if self._paused.is_set():
                self._queue.put(_RESUME)

    resume = cancel

    def orphaned(self) -> None:
        """The notebook went away: resume after ``pause_timeout`` unless one attaches
        (and asks again) before."""
        with self._lock:
            if self.boundary.target is None and not self._paused.is_set():
                return
            self._deadline = time.monotonic() + self.pause_timeout
        log.info(
            "the notebook went away; resuming in %.0f s unless one attaches", self.pause_timeout
        )

    def adopted(self) -> None:
        """A notebook attached again: the pause waits for it, not for the deadline."""
        with self._lock:
            self._deadline = None

    def submit(self, function: Callable[[CellNamespace], Any], timeout: float | None) -> Any:
        """``function(namespace)`` run in the paused training thread; its result (or what
        it raised, raised here). :class:`NotPaused` when the rank is not paused;
        ``TimeoutError`` when it has not finished within ``timeout`` (it goes on)."""
        if not self._paused.is_set():
            raise NotPaused("this rank is not paused")
        work = _Work(function, threading.Event())
        self._queue.put(work)
        if not work.done.wait(timeout):
            raise TimeoutError(f"the paused rank did not finish within {timeout} s")
        if work.error is not None:
            raise work.error
        return work.result

    # ------------------------------------------------------------------ the training thread

    def _serve(self, point: StopPoint) -> None:
        """The stop: serve work until resumed (or the deadline of a notebook gone)."""
        main = sys.modules.get("__main__")
        namespace = CellNamespace(vars(main) if main is not None else {}, point.frame)
        with self._lock:  # against a cancel or a new step asked meanwhile
            if self.boundary.target != point.step:
                return
            while not self._queue.empty():  # a resume meant for an earlier stop
                self._queue.get_nowait()
            self._namespace = namespace
            self._point = point
            self._paused.set()
        log.info("paused after step %d", point.step)
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    deadline = self._deadline
                    if deadline is not None and time.monotonic() >= deadline:
                        log.info(
                            "no notebook attached again within %.0f s: resuming", self.pause_timeout
                        )
                        with self._lock:
                            self._deadline = None
                            self.boundary.cancel()
                        break
                    continue
                if item is _RESUME:
                    break
                try:
                    item.result = item.function(self._namespace)
                except BaseException as error:  # the notebook's call failed, not the job
                    item.error = error
                finally:
                    item.done.set()
        finally:
            self._paused.clear()
            self._point = None
            self._namespace = None
            log.info("resumed after step %d", point.step)
