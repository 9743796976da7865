"""What a recovery shows while it runs: the phase it waits in, from its first moment.

A recovery takes seconds (a minute on a loaded machine): ending the old group, starting a
fresh one, finding the snapshots, replaying each cell, loading the snapshot. The phase
under way is one line, rewritten as the recovery moves on, where a pool start shows its
phases (:func:`._start_progress.phase_line`): a display updated in place in a Jupyter
kernel, the last line of stderr rewritten with a carriage return on a terminal (only the
ending line on a file or a pipe); it ends showing how the recovery ended. Each finished step is an ordinary line of stdout
(``recovery: replayed In[2] in 0.41 s``). With ``IPP_NONINTERACTIVE`` set (a batch run)
the phases are not shown; the finished steps are.

Given a ``say`` (``Pool.recover(say=...)``, the Snapshots panel's status line), every
line, the phases' too, goes to it instead, in order.

Faults: nothing here talks to the ranks; a recovery that fails ends its line
(:meth:`RecoveryProgress.close`) before its error is shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fsdp_interactive.pool._start_progress import interactive, phase_line


class RecoveryProgress:
    """The lines of one recovery (``say``: hand them to it instead of printing them)."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self._say = say
        self._line = phase_line() if say is None and interactive() else None
        self._began = self._phase_began = time.monotonic()
        self._phase = ""

    def phase(self, what: str) -> None:
        """The recovery now waits for ``what`` (``ending the old group``): shown at once,
        in place of the phase before."""
        self._phase_began = time.monotonic()
        self._phase = what
        line = f"recovery: {what} ..."
        if self._say is not None:
            self._say(line)
        elif self._line is not None:
            self._line.show(line)

    def seconds(self) -> float:
        """Seconds since the current phase began."""
        return time.monotonic() - self._phase_began

    def done(self, what: str) -> None:
        """A finished step (``replayed In[2] in 0.41 s``), as an ordinary line."""
        line = f"recovery: {what}"
        if self._say is not None:
            self._say(line)
        elif self._line is not None:
            self._line.notice(line, "stdout")
        else:
            print(line, flush=True)

    def close(self, ended: bool) -> None:
        """The recovery ended (``ended``) or failed: the phase line says so."""
        if self._line is None or not self._phase:
            return
        total = time.monotonic() - self._began
        how = "ended" if ended else f"failed while {self._phase}"
        self._line.end(f"recovery: {how} after {total:.1f} s")
