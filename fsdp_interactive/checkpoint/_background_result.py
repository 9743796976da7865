"""The outcome of work a collective call leaves running in a background thread, and the
latest such work of a process: one type for an async checkpoint save and a background
snapshot.

:class:`BackgroundResult` is a :class:`concurrent.futures.Future`, as ipyparallel's
``AsyncResult`` is, rather than a class of its own: the future's state machine (pending,
finished with a value or an error, waiters woken once) is the standard library's, and a
handle works with what already takes futures: ``concurrent.futures.wait`` and
``as_completed``, ``add_done_callback``, and ``asyncio.wrap_future`` (``await`` it in a
notebook cell). What the handles documented before they were futures stays:

* ``wait(timeout)`` returns the value or raises the work's error, and raises
  ``TimeoutError`` naming what is still running after ``timeout`` seconds (``result``
  is the future's own, with its bare ``TimeoutError``);
* ``exception()`` does not block: ``None`` while the work runs or once it succeeded
  (a future's ``exception()`` would wait);
* the work cannot be cancelled: a handle is running from the moment it is made, so
  ``cancel()`` returns ``False`` (the collectives it runs cannot be taken back on one rank).

:class:`LatestInFlight` holds a process's latest background result so that the next
save, snapshot, load or restore waits for it first. The work is a collective that every
rank starts from one thread: it is not a queue for work started from several threads of
one process.

If a rank dies or a host goes away while the work runs, the surviving ranks' collectives
fail (gloo reports the closed connection, at the latest after the group's timeout): the
work's error is set on the result, and ``wait`` raises it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R", bound="BackgroundResult")


class BackgroundResult(concurrent.futures.Future, Generic[T]):
    """A value that work running in the background sets once, or the error it raised.

    Subclasses say what the work is: :meth:`_subject` (shown in the ``repr``),
    :meth:`_still_running` (the ``TimeoutError`` of :meth:`wait`) and
    :attr:`_finished_word` (the ``repr`` of a success).
    """

    _finished_word = "done"

    def __init__(self) -> None:
        super().__init__()
        # Running from the start: nothing a caller does can cancel a collective.
        self.set_running_or_notify_cancel()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the work has finished and return its value; raise its error, or
        ``TimeoutError`` after ``timeout`` seconds (the work goes on)."""
        finished, _ = concurrent.futures.wait([self], timeout)
        if not finished:
            raise TimeoutError(self._still_running(timeout))
        return self.result()

    def exception(self, timeout: float | None = 0.0) -> BaseException | None:
        """The work's error once it has finished; ``None`` while it runs or when it
        succeeded. It waits up to ``timeout`` seconds first (``None``: until finished);
        by default it does not wait."""
        if timeout != 0.0:
            concurrent.futures.wait([self], timeout)
        return super().exception() if self.done() else None

    def run_in_thread(
        self,
        work: Callable[[], T],
        thread_name: str,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        """Run ``work()`` on a daemon thread named ``thread_name``; its value or its error
        (after ``on_failure(error)``, which logs it) becomes this result's."""

        def run() -> None:
            try:
                value = work()
            except BaseException as error:
                on_failure(error)
                self.set_exception(error)
            else:
                self.set_result(value)

        threading.Thread(target=run, name=thread_name, daemon=True).start()

    def _subject(self) -> str:
        raise NotImplementedError

    def _still_running(self, timeout: float | None) -> str:
        raise NotImplementedError

    def _repr_details(self) -> str:
        """What the ``repr`` shows after the state (empty, or ``", ..."``)."""
        return ""

    def __repr__(self) -> str:
        if not self.done():
            state = "running"
        else:
            state = "failed" if self.exception() is not None else self._finished_word
        return f"{type(self).__name__}({self._subject()!r}, {state}{self._repr_details()})"


class LatestInFlight(Generic[R]):
    """A process's latest background result (finished or still running)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: R | None = None

    def hold(self, result: R) -> None:
        """Keep ``result`` as the latest, in place of the one before."""
        with self._lock:
            self._latest = result

    def latest(self) -> R | None:
        """The latest result held, finished or not; ``None`` when none was."""
        with self._lock:
            return self._latest

    def running(self) -> R | None:
        """The latest result while its work still runs, else ``None``."""
        latest = self.latest()
        return latest if latest is not None and not latest.done() else None

    def wait(self) -> None:
        """Wait until the running work, if any, has finished; its error stays on its
        result (this does not raise it)."""
        running = self.running()
        if running is not None:
            logger.info("waiting for %r to finish", running)
            concurrent.futures.wait([running])
