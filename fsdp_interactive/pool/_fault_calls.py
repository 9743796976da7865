"""The pool's calls about faults: is every rank alive, back to a snapshot, which snapshots.

:class:`FaultCalls` is a part of :class:`~._pool.Pool` (a base class). ``check()`` looks
for ranks that died since the last call (:mod:`._faults`), ``recover()`` plans, checks
and carries out a recovery (:mod:`._recovery`, :mod:`._recovery_checks`), ``snapshots()``
lists what the kernel heard of (:mod:`._snapshots`).
"""

from __future__ import annotations

import inspect
import logging
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp_interactive.pool._pool_state import PoolHealth, PoolState
from fsdp_interactive.pool._recovery import RecoveryPlan, RecoveryReport, execute, make_plan
from fsdp_interactive.pool._recovery_progress import RecoveryProgress
from fsdp_interactive.pool._snapshots import SnapshotBook, SnapshotInfo
from fsdp_interactive.pool.errors import START, PoolNotRunning, RecoveryError

if TYPE_CHECKING:
    from fsdp_interactive.pool._faults import PoolFaults

log = logging.getLogger(__name__)


def _print(line: str) -> None:
    print(line, flush=True)


class FaultCalls:
    """``check``, ``recover`` and ``snapshots`` of a pool."""

    _state: PoolState
    _faults: PoolFaults
    _snapshot_book: SnapshotBook

    def check(self) -> PoolHealth:
        """Whether every rank still runs. Ranks that died since the last call (and engine
        forkers that ended) are noticed here, as before every call: a group that lost a
        rank is torn down, and the next call raises its :class:`RankDied` instead of
        running. Returns the :class:`PoolHealth` found (``death``: that error)."""
        return self._faults.notice()

    def recover(
        self,
        from_: str | os.PathLike | None = None,
        *,
        world: int | None = None,
        dry_run: bool = False,
        say: Callable[[str], None] | None = None,
    ) -> RecoveryReport | RecoveryPlan:
        """Bring the ranks back to a snapshot: after ``RankDied``, a wedged collective, a
        lost host, or at any time.

        Ends what is left of the group, starts a fresh one (on the hosts that remain; on
        ``world`` ranks when given, resharding), replays the journal's calls that rebuild the
        objects the snapshot restores into (the slice, :mod:`._slice`; the plan says each
        call's part and why), and loads the snapshot into them (model, optimizer, RNG,
        stateful objects). ``from_``: a snapshot id (default: the newest) or a checkpoint
        folder. ``dry_run``: only return (and print) the plan, after the same checks.
        Prints its progress (``say``: hands each line to it instead) and returns a
        :class:`RecoveryReport` (the snapshot's step and age, the calls replayed, each
        phase's seconds). Raises :class:`RecoveryError` with the pool as it was for
        what the checks refuse before anything ends (nothing to recover to, a folder that
        is not a snapshot, a damaged record, one that does not fit the live objects: see
        :mod:`._recovery_checks`); when a replayed call fails, the pool then runs a fresh,
        empty group. See :mod:`._recovery`.
        """
        if self._state is PoolState.STOPPED:
            raise PoolNotRunning("the pool is stopped (and its snapshots freed)", START)
        shown = say or _print
        with self._faults.recovering():
            self._faults.notice()  # a rank dead since the last call: no check asks the ranks
            try:
                plan = make_plan(self, from_, world)
            except RecoveryError as refused:
                planned = getattr(refused, "plan", None)
                if dry_run and planned is not None:
                    shown(str(planned))
                raise
            if dry_run:
                shown(str(plan))
                return plan
            report = execute(self, plan, RecoveryProgress(say))
            self._faults.lost_hosts = []
            shown(str(report))
            self._recovered(report)
        return report

    def when_recovered(self, callback: Callable[[RecoveryReport], None]) -> None:
        """Call ``callback(report)`` after every recovery that succeeds (by
        :meth:`recover`, or by itself with ``recover="auto"``): what a view of the ranks
        refreshes on. A bound method is held weakly (a view that is gone is not called);
        a callback that raises is logged and does not fail the recovery."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        held = weakref.WeakMethod(callback) if inspect.ismethod(callback) else (lambda: callback)
        self.__dict__.setdefault("_recovery_watchers", []).append(held)

    def _recovered(self, report: RecoveryReport) -> None:
        watchers = self.__dict__.get("_recovery_watchers", [])
        watchers[:] = [held for held in watchers if held() is not None]
        for held in list(watchers):
            callback = held()
            if callback is None:
                continue
            try:
                callback(report)
            except Exception as error:
                log.warning("a callback after the recovery failed: %s", error)

    def snapshots(self) -> list[SnapshotInfo]:
        """The snapshots the kernel heard of, oldest first (see :mod:`._snapshots`)."""
        self._faults.take_notices()
        return self._snapshot_book.all()
