"""What a save reports, and the one asynchronous save a process may have running.

A save is a collective call every rank makes from one thread; :data:`INFLIGHT` keeps
the latest asynchronous save of this process so that the next save (or a load) can wait
for it or refuse to start. It is not a queue for saves started concurrently from
several threads of one process. The handle and the holder are the background result of
:mod:`._background_result`, which a background snapshot's handle shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint._background_result import BackgroundResult, LatestInFlight
from fsdp_interactive.checkpoint._format._manifest import CheckpointRecord
from fsdp_interactive.checkpoint.errors import CheckpointBusyError

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


class SaveHandle(BackgroundResult[SaveResult]):
    """A save's outcome, once known. ``wait()`` returns its :class:`SaveResult`.

    An asynchronous save publishes its checkpoint from a background thread whether or
    not ``wait`` is called; ``wait`` re-raises the save's error, if any, and a
    ``TimeoutError`` after ``timeout`` leaves the save running. A
    :class:`concurrent.futures.Future` (``result``, ``add_done_callback``,
    ``asyncio.wrap_future``), except that ``exception()`` does not block and a save
    cannot be cancelled.
    """

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    # Defined here, not only inherited, so that the API reference lists them.
    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until published; raise its error, or ``TimeoutError`` after ``timeout``."""
        return super().wait(timeout)

    def done(self) -> bool:
        """True once the save has finished (published or failed)."""
        return super().done()

    def exception(self, timeout: float | None = 0.0) -> BaseException | None:
        """The save's error once done (``None`` while running or on success); it waits
        up to ``timeout`` seconds for the save to finish first (by default not at all)."""
        return super().exception(timeout)

    def _subject(self) -> str:
        return self.path

    def _still_running(self, timeout: float | None) -> str:
        return f"checkpoint save to {self.path} still running after {timeout}s"


class InflightSave(LatestInFlight[SaveHandle]):
    """The latest asynchronous save of this process (done or still running)."""

    def make_room(self, if_busy: IfBusy, ranks: Ranks) -> None:
        """Wait for the running save (``"wait"``) or refuse to start (``"error"``).

        With ``"error"`` the ranks agree first, so either all of them refuse or none
        does. Waiting does not raise the running save's error: that belongs to its handle.
        """
        if if_busy not in ("wait", "error"):
            raise ValueError(f"if_busy must be 'wait' or 'error', got {if_busy!r}")
        if if_busy == "wait":
            self.wait()
            return
        running = self.running()
        busy_ranks = [r for r, busy in enumerate(ranks.all_gather(running is not None)) if busy]
        if busy_ranks:
            where = running.path if running is not None else "another checkpoint"
            raise CheckpointBusyError(
                f"a checkpoint save ({where}) is still running on rank(s) {busy_ranks}; "
                "wait for its handle or pass if_busy='wait'"
            )


INFLIGHT = InflightSave()
