"""What ``snapshot(background=True)`` returns, and the one snapshot a process may have in
flight.

A snapshot is a collective call every rank makes from one thread. :data:`INFLIGHT` keeps
this process's latest background snapshot so that the next snapshot, a restore or a
persist waits for it first: one snapshot is written at a time, and a second one started
while the first is in flight waits (it does not raise). It is not a queue for snapshots
started from several threads at once. The handle and the holder are the background
result of :mod:`.._background_result`, which an async checkpoint save's handle shares.
"""

from __future__ import annotations

from fsdp_interactive.checkpoint._background_result import BackgroundResult, LatestInFlight
from fsdp_interactive.checkpoint._format._snapshot_record import SnapshotRecord


class SnapshotHandle(BackgroundResult[SnapshotRecord]):
    """A background snapshot: its ``id`` and blocking ``seconds`` at once, its record once
    published.

    The snapshot is written and published on a background thread whether or not
    :meth:`wait` is called. A :class:`concurrent.futures.Future` (``result``,
    ``add_done_callback``, ``asyncio.wrap_future``), except that ``exception()`` does not
    block and a snapshot cannot be cancelled.

    If a rank dies or a host goes away while it is written, the surviving ranks' writes
    fail (gloo reports the closed connection, at the latest after the process group's
    timeout) and :meth:`wait` raises that error; the previous snapshot stays published
    and the unfinished one is never listed.
    """

    _finished_word = "published"

    def __init__(self, snapshot_id: str, seconds: float):
        super().__init__()
        self.id = snapshot_id
        self.seconds = seconds

    # Defined here, not only inherited, so that the API reference lists them.
    def wait(self, timeout: float | None = None) -> SnapshotRecord:
        """Block until published and return its record; raise its error, or
        ``TimeoutError`` after ``timeout`` seconds (the snapshot goes on)."""
        return super().wait(timeout)

    def done(self) -> bool:
        """True once the snapshot is published or has failed."""
        return super().done()

    def exception(self, timeout: float | None = 0.0) -> BaseException | None:
        """The snapshot's error once done (``None`` while running or on success); it
        waits up to ``timeout`` seconds for the snapshot first (by default not at all)."""
        return super().exception(timeout)

    def _subject(self) -> str:
        return self.id

    def _still_running(self, timeout: float | None) -> str:
        return f"snapshot {self.id} still being written after {timeout}s"

    def _repr_details(self) -> str:
        return f", blocking {self.seconds:.3f}s"


#: This process's latest background snapshot (done or still running).
INFLIGHT: LatestInFlight[SnapshotHandle] = LatestInFlight()
