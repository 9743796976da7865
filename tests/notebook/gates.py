"""Loops on the ranks that advance only once the notebook side has seen their progress.

A test that says a bar moves *while* a cell runs cannot time it; instead every step of
the loop waits for a gate file, and the test opens gate ``i`` only when what the kernel
showed (a terminal's transcript, the kernel's IOPub messages, JupyterLab's page) holds
step ``i`` of the bar. Were the bar shown only at the end, no gate would open from what
was seen: a fallback opens the rest after ``fallback_s`` so that the cell ends, and the
test then finds gates that its observations did not open.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path


def gated_loop(gates: Path, steps: int, bar: str, body: str = "", setup: str = "") -> str:
    """Cell code: ``<setup>; for i in <bar>(range(steps)): <body>; wait for gate i``.

    ``bar`` is the loop's iterable expression around ``range(steps)``, e.g.
    ``"tqdm(RANGE, desc='steps', mininterval=0)"`` (``RANGE`` is replaced by the range);
    ``mininterval=0`` makes tqdm draw every step (it would skip steps closer than 0.1 s).
    """
    iterable = bar.replace("RANGE", f"range({steps})")
    return (
        (setup + "\n" if setup else "") + "import os as _os, time as _time\n"
        f"for i in {iterable}:\n"
        + "".join(f"    {line}\n" for line in body.splitlines())
        + f"    while not _os.path.exists({str(gates)!r} + f'/go{{i}}'):\n"
        "        _time.sleep(0.02)\n"
    )


class Gates:
    """The gate files of one gated loop of ``steps`` steps, opened by :meth:`observe`.

    ``shown(i)`` is a regular expression that matches what shows step ``i`` (by default
    ``" i/steps "``, as tqdm prints its count). ``opened_by_sight`` lists the gates that
    an observation opened, in order.
    """

    def __init__(self, folder: Path, steps: int, fallback_s: float = 120.0) -> None:
        self.folder = folder
        self.steps = steps
        self.opened_by_sight: list[int] = []
        self._next = 0
        self._lock = threading.Lock()
        self._fallback = threading.Timer(fallback_s, self.open_all)
        self._fallback.daemon = True
        self._fallback.start()

    def pattern(self, step: int) -> re.Pattern[str]:
        return re.compile(rf"(?<!\d){step}/{self.steps}(?!\d)")

    def observe(self, text: str) -> None:
        """Open the next gate when ``text`` (something the kernel showed) holds its step."""
        with self._lock:
            while self._next < self.steps and self.pattern(self._next).search(text):
                self.opened_by_sight.append(self._next)
                self._open(self._next)
                self._next += 1

    def _open(self, step: int) -> None:
        (self.folder / f"go{step}").touch()

    def open_all(self) -> None:
        """Let the loop finish (the fallback, and the end of every test)."""
        for step in range(self.steps):
            self._open(step)

    def close(self) -> None:
        self._fallback.cancel()
        self.open_all()


def held_until(path: Path | str) -> str:
    """Code (an expression, value ``False``) that waits, where it runs, until ``path``
    exists: for a rank's cell or debugger command that the test lets go. It imports
    nothing of the tests (a rank need not find them)."""
    return (
        "any(__import__('time').sleep(0.02) for _ in "
        f"iter(lambda: not __import__('os').path.exists({str(path)!r}), False))"
    )


def one_sided_barrier(gate: Path, then: str = "") -> str:
    """Cell code whose rank 0 waits in a barrier that rank 1 does not reach: rank 1
    finishes the cell, and a thread of it enters the barrier once ``gate`` exists (the
    test opens it when it has seen the wait); rank 0 then runs ``then`` (one line).
    The barrier is on line 8 of the cell."""
    return (
        "import threading\n"
        "def _arrive_later():\n"
        f"    {held_until(gate)}\n"
        "    dist.barrier()\n"
        "if rank == 1:\n"
        "    threading.Thread(target=_arrive_later, daemon=True).start()\n"
        "else:\n"
        "    dist.barrier()\n" + (f"    {then}\n" if then else "")
    )


class WatchedStream(io.StringIO):
    """A text stream (``sys.stderr`` of a test) that opens ``gate`` once what was written
    to it holds ``seen``."""

    def __init__(self, gate: Path, seen: str) -> None:
        super().__init__()
        self.gate, self.seen = gate, seen

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.seen in self.getvalue():
            self.gate.touch()
        return written


@contextlib.contextmanager
def stderr_opening(gate: Path, seen: str, fallback_s: float = 120.0) -> Iterator[WatchedStream]:
    """``sys.stderr`` replaced, for the block, by a :class:`WatchedStream` that opens
    ``gate`` once it holds ``seen``; the gate opens after ``fallback_s`` anyway (and at the
    end), so that what waits for it ends."""
    stream = WatchedStream(gate, seen)
    fallback = threading.Timer(fallback_s, gate.touch)
    fallback.daemon = True
    fallback.start()
    saved, sys.stderr = sys.stderr, stream
    try:
        yield stream
    finally:
        sys.stderr = saved
        fallback.cancel()
        gate.touch()
