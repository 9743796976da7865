"""What ``snapshot(background=True)`` returns, and the one snapshot a process may have in
flight.

A snapshot is a collective call every rank makes from one thread. :data:`INFLIGHT` keeps
this process's latest background snapshot so that the next snapshot, a restore or a
persist waits for it first: one snapshot is written at a time, and a second one started
while the first is in flight waits (it does not raise). It is not a queue for snapshots
started from several threads at once.
"""

from __future__ import annotations

import logging
import threading

from fsdp_interactive.checkpoint._snapshot._record import SnapshotRecord

logger = logging.getLogger(__name__)


class SnapshotHandle:
    """A background snapshot: its ``id`` and blocking ``seconds`` at once, its record once
    published.

    The snapshot is written and published on a background thread whether or not
    :meth:`wait` is called. If a rank dies or a host goes away while it is written, the
    surviving ranks' writes fail (gloo reports the closed connection, at the latest after
    the process group's timeout) and :meth:`wait` raises that error; the previous
    snapshot stays published and the unfinished one is never listed.
    """

    def __init__(self, snapshot_id: str, seconds: float):
        self.id = snapshot_id
        self.seconds = seconds
        self._done = threading.Event()
        self._record: SnapshotRecord | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the snapshot is published or has failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SnapshotRecord:
        """Block until published and return its record; raise its error, or
        ``TimeoutError`` after ``timeout`` seconds (the snapshot goes on)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"snapshot {self.id} still being written after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._record is not None
        return self._record

    def exception(self) -> BaseException | None:
        """The snapshot's error once done (``None`` while running or on success)."""
        return self._error if self._done.is_set() else None

    def _finish(self, record: SnapshotRecord | None, error: BaseException | None = None) -> None:
        self._record, self._error = record, error
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "published")
        return f"SnapshotHandle({self.id!r}, {state}, blocking {self.seconds:.3f}s)"


class InflightSnapshot:
    """This process's latest background snapshot (done or still running)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: SnapshotHandle | None = None

    def hold(self, handle: SnapshotHandle) -> None:
        with self._lock:
            self._latest = handle

    def wait(self) -> None:
        """Wait until the running background snapshot, if any, has finished; its error
        stays on its handle."""
        with self._lock:
            latest = self._latest
        if latest is not None and not latest.done():
            logger.info("waiting for snapshot %s, still being written", latest.id)
            latest._done.wait()


INFLIGHT = InflightSnapshot()
