"""What a save reports, and the one asynchronous save a process may have running.

A save is a collective call every rank makes from one thread; :data:`INFLIGHT` keeps
the latest asynchronous save of this process so that the next save (or a load) can wait
for it or refuse to start. It is not a queue for saves started concurrently from
several threads of one process.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Literal

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint._manifest import CheckpointRecord
from fsdp_interactive.checkpoint.errors import CheckpointBusyError

logger = logging.getLogger(__name__)

IfBusy = Literal["wait", "error"]


@dataclass(frozen=True)
class SaveResult:
    """What a finished save reports (identical on every rank)."""

    path: str
    step: int | None
    world_size: int
    size_bytes: int
    seconds: float
    removed_by_rotation: list[str] = field(default_factory=list)
    record: CheckpointRecord | None = None


class SaveHandle:
    """A save's outcome, once known. ``wait()`` returns its :class:`SaveResult`.

    An asynchronous save publishes its checkpoint from a background thread whether or
    not ``wait`` is called; ``wait`` re-raises the save's error, if any.
    """

    def __init__(self, path: str):
        self.path = path
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the save has finished (published or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until published; raise its error, or ``TimeoutError`` after ``timeout``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint save to {self.path} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self) -> BaseException | None:
        """The save's error once done (``None`` while running or on success)."""
        return self._error if self._done.is_set() else None

    def _finish(self, result: SaveResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return f"SaveHandle({self.path!r}, {state})"


class InflightSave:
    """The latest asynchronous save of this process (done or still running)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: SaveHandle | None = None

    def hold(self, handle: SaveHandle) -> None:
        with self._lock:
            self._latest = handle

    def latest(self) -> SaveHandle | None:
        with self._lock:
            return self._latest

    def running(self) -> SaveHandle | None:
        latest = self.latest()
        return latest if latest is not None and not latest.done() else None

    def make_room(self, if_busy: IfBusy, ranks: Ranks) -> None:
        """Wait for the running save (``"wait"``) or refuse to start (``"error"``).

        With ``"error"`` the ranks agree first, so either all of them refuse or none
        does. Waiting does not raise the running save's error: that belongs to its handle.
        """
        if if_busy not in ("wait", "error"):
            raise ValueError(f"if_busy must be 'wait' or 'error', got {if_busy!r}")
        running = self.running()
        if if_busy == "error":
            busy_ranks = [r for r, busy in enumerate(ranks.all_gather(running is not None)) if busy]
            if busy_ranks:
                where = running.path if running is not None else "another checkpoint"
                raise CheckpointBusyError(
                    f"a checkpoint save ({where}) is still running on rank(s) {busy_ranks}; "
                    "wait for its handle or pass if_busy='wait'"
                )
            return
        if running is not None:
            logger.info("waiting for the running save of %s to finish", running.path)
            running._done.wait()


INFLIGHT = InflightSave()
