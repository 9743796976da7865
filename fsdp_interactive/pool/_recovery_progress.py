"""What a recovery shows while it runs: the phase it waits in, from its first moment.

A recovery takes seconds (a minute on a loaded machine): ending the old group, starting a
fresh one, finding the snapshots, replaying each cell, loading the snapshot. The phase
under way is one line that moves in place on stdout, rewritten with a carriage return
(:class:`fsdp_interactive._status_line.StatusLines`): in a terminal, and in a notebook,
whose front ends rewrite a stream's line the same way. Each finished step becomes an
ordinary line (``recovery: replayed In[2] in 0.41 s``), which replaces the moving one.

Given a ``say`` (``Pool.recover(say=...)``, the Snapshots panel's status line), every
line, the phases' too, goes to it instead, in order.

Faults: nothing here talks to the ranks; a recovery that fails ends its moving line
(:meth:`RecoveryProgress.close`) before its error is shown.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from fsdp_interactive._status_line import StatusLines

_KEY = "recovery"


class RecoveryProgress:
    """The lines of one recovery (``say``: hand them to it instead of printing them)."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self._say = say
        self._status = StatusLines(lambda _: sys.stdout) if say is None else None
        self._phase_began = time.monotonic()

    def phase(self, what: str) -> None:
        """The recovery now waits for ``what`` (``ending the old group``): shown at once,
        in place of the phase before."""
        self._phase_began = time.monotonic()
        line = f"recovery: {what} ..."
        if self._status is None:
            assert self._say is not None
            self._say(line)
        else:
            self._status.update(_KEY, "stdout", line)

    def seconds(self) -> float:
        """Seconds since the current phase began."""
        return time.monotonic() - self._phase_began

    def done(self, what: str) -> None:
        """A finished step (``replayed In[2] in 0.41 s``), as an ordinary line."""
        self.line(f"recovery: {what}")

    def line(self, text: str) -> None:
        """An ordinary line (the report), after the moving one is taken away."""
        if self._status is None:
            assert self._say is not None
            self._say(text)
        else:
            self._status.end(_KEY, "stdout", text)

    def close(self) -> None:
        """Take the moving line away (the recovery ended, or failed)."""
        if self._status is not None:
            self._status.end(_KEY, "stdout", None)
