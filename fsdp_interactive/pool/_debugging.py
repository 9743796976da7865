"""The pool's debugging calls: stacks, collectives, post-mortem pdb and interrupts.

:class:`DebuggingCalls` is a part of :class:`~._pool.Pool` (a base class): each call asks
the running group's ranks over their diagnostics agents (:mod:`.diagnostics`), the same way
for local and remote ranks, and works while ranks are busy or blocked.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fsdp_interactive.pool._dispatch import Targets, resolve_targets
from fsdp_interactive.pool.common._collectives import CollectiveTrace
from fsdp_interactive.pool.diagnostics._interrupt import InterruptReport
from fsdp_interactive.pool.diagnostics._post_mortem import DebuggerOutput, debug_command
from fsdp_interactive.pool.errors import PoolNotRunning

if TYPE_CHECKING:
    from fsdp_interactive.pool._live_group import LiveGroup


class DebuggingCalls:
    """``stacks``, ``trace``, ``debug``, ``interrupt`` and ``busy_ranks`` of a pool."""

    interrupt_grace: float
    pg_timeout: float
    needs_restart: bool

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def _running(self) -> LiveGroup:
        raise NotImplementedError

    def snapshots(self) -> list[Any]:
        raise NotImplementedError

    def interrupt(self, targets: Targets = None) -> InterruptReport:
        """Send SIGINT to the targeted ranks (through ipyparallel's nanny); say what it did.

        When ranks still run a call that timed out or was interrupted, waits up to
        ``interrupt_grace`` seconds for those calls to end and reports per rank whether
        it stopped; a rank blocked inside a collective cannot be freed by SIGINT (the
        signal is handled only when the C++ call returns): it is reported as blocked
        and the pool then needs ``restart()``. Called while another thread waits on a
        call, it only signals (that call reports the outcome).
        """
        live = self._running()
        report = live.interrupt(resolve_targets(targets, self.world_size), self.interrupt_grace)
        if report.needs_restart:
            self.needs_restart = True
        return dataclasses.replace(report, snapshot_taken=bool(self.snapshots()))

    def busy_ranks(self) -> list[int]:
        """Ranks still running a call that timed out or was interrupted."""
        try:
            return self._running().unfinished.busy_ranks()
        except PoolNotRunning:
            return []

    def stacks(
        self, code: str | None = None, *, native: bool = False
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Every rank's current Python stack, without stopping any rank.

        Returns ``(stacks, where)``: ``stacks[rank]`` in traceback order with each
        frame's source line, and ``where[rank]`` a one-line summary. ``native=True``
        appends py-spy's native (C/C++) frames of each rank's user thread, run on the
        rank's host (needs py-spy there and ptrace permission; see
        :func:`pool.rank._thread_stacks.native_stack`). Ranks answer through their diagnostics
        agents; a rank whose agent cannot answer is asked by signal instead.
        """
        return self._running().stacks(code, native=native)

    def trace(
        self, last: int = 20, targets: Targets = None, *, issued_at: bool = False
    ) -> CollectiveTrace:
        """Every rank's recent collectives (torch's flight recorder) and where they disagree.

        ``str()`` of the result is the findings ("rank 0 waits in barrier #12; rank 1
        never issued #12 ...") and a table of the last ``last`` collectives per process
        group, merged across ranks that agree. Works while ranks are busy or blocked.
        ``issued_at=True`` adds the line that issued each collective; the first such call
        makes torch load its stack symbolizer on every rank (about 1.4 s and 70 MB each).
        """
        live = self._running()
        if isinstance(last, bool) or not isinstance(last, int) or last < 1:
            raise ValueError(f"last must be a number of collectives >= 1, got {last!r}")
        return live.trace(resolve_targets(targets, self.world_size), last, issued_at=issued_at)

    def debug(self, rank: int, command: str | None = None) -> DebuggerOutput:
        """Run one pdb ``command`` on the last exception a notebook cell raised on ``rank``.

        The session lives on between calls (``up`` stays up) until ``q``; without a
        command it starts (or shows where it stands). Returns pdb's output. Cells count
        when run with ``run(..., cell=N)`` (as ``%%fsdp`` does). Raises ``PoolError`` when
        the rank has no failure to look at.
        """
        live = self._running()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank!r}")
        if command is not None and not isinstance(command, str):
            raise TypeError(f"command must be a pdb command (str) or None, got {command!r}")
        return debug_command(live.diagnosis.agents, rank, command, hold_s=self.pg_timeout)
