"""A private event loop thread on which the pool drives ipyparallel's ``Cluster``.

``Cluster``'s ``*_sync`` methods run each coroutine on a throw-away loop when the
caller has no running loop (a script, pytest). Launchers keep a reference to the loop
that was current when they were created and report process exits through it; on a
throw-away loop those reports (exit codes, captured output) are lost. Running every
cluster coroutine on one long-lived loop keeps them, in a notebook kernel and in a
script alike.

Not done here: nothing is cancelled on timeout; the caller decides what to stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
#: Seconds between two calls of a ``run``'s ``poll``.
POLL_S = 0.05


class LoopThread:
    """One daemon thread running an asyncio loop; ``run`` executes a coroutine on it."""

    def __init__(self, name: str = "fsdp-interactive-pool") -> None:
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        self._loop.run_forever()

    def run(
        self,
        make_coro: Callable[[], Awaitable[T]],
        timeout: float | None = None,
        *,
        poll: Callable[[], None] | None = None,
    ) -> T:
        """Run ``make_coro()`` on the loop thread and wait for its result.

        ``make_coro`` is called on the loop thread, so objects it creates (launchers)
        see this loop as the current one. Raises ``TimeoutError`` after ``timeout``
        seconds (the coroutine keeps running) and re-raises the coroutine's exception.
        ``poll()``, when given, is called on the waiting thread every
        :data:`POLL_S` seconds while the coroutine runs (to show its progress there).
        """

        async def wrapper() -> Any:
            return await make_coro()

        future = asyncio.run_coroutine_threadsafe(wrapper(), self._loop)
        if poll is None:
            return future.result(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            poll()
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            try:
                result = future.result(max(left, 0.0))
            except concurrent.futures.TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            poll()
            return result

    def close(self) -> None:
        """Stop the loop and join the thread; idempotent."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
