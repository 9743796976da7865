"""What a pool does when a call ends badly or a process of the group dies, and what the
ranks tell it unasked.

:class:`PoolFaults` is part of a :class:`~._pool.Pool`:

* :meth:`~PoolFaults.outcome` wraps every call: it records how a ``run`` ended in its
  journal entry, names only steps that can work (no recovery advised while no snapshot
  exists) and, with ``Pool(recover="auto")``, recovers from a dead rank or a collective
  the ranks are blocked in (:mod:`._recovery`, its phases printed as they pass), then lets
  the call's error go on with what was restored added to its message;
* :meth:`~PoolFaults.fail_dead` is how a waiting call reports dead ranks, and
  :meth:`~PoolFaults.notice` how the pool finds ranks that died while no call ran (the
  OOM killer between cells, a ``kill -9``): before every call and whenever asked
  (``Pool.check()``, ``%fsdp status``). Either way the error is built at once and the
  group is torn down on a thread (with remote engines that takes ssh round trips) that
  every later start, stop, restart or recovery waits for first. A death noticed outside
  a call is raised by the next call, which does not run (and so is recovered from there
  with ``recover="auto"``); later calls say that the group is gone, until a recovery or
  a restart;
* an engine forker that ended while its host stays up is noticed at the same moments:
  a new one takes its place on that host (the next group forks from it, and it removes
  the host's snapshot root when the pool stops), and the next call and ``Pool.check()``
  say so; the ranks it forked run on;
* :meth:`~PoolFaults.take_notices` reads the notices the ranks sent (snapshot records)
  into the pool's snapshot book and journal: after every journaled call, and before a
  group's links close, so a notice sent just before a rank died is kept.

Hosts whose every rank vanished at once (a ``RankDied`` naming lost hosts) are kept in
:attr:`~PoolFaults.lost_hosts` until a recovery leaves them out.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from fsdp_interactive.pool._journal import JournalEntry, outcome_of
from fsdp_interactive.pool._pool_state import PoolHealth, PoolState
from fsdp_interactive.pool._recovery import execute, make_plan
from fsdp_interactive.pool._recovery_progress import RecoveryProgress
from fsdp_interactive.pool.errors import (
    RECOVER,
    Advised,
    RankDied,
    RankError,
    RankTimeout,
    describe_exit,
)

#: A :class:`~._pool.Pool` (not imported: the pool imports this module).
Pool = Any

log = logging.getLogger(__name__)

#: Seconds to wait, after a rank died, for the deaths that come with it.
DEATHS_SETTLE_S = 0.5


def _say(line: str) -> None:
    print(line, flush=True)


class PoolFaults:
    """The fault handling of ``pool``."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._cleanup: threading.Thread | None = None
        #: Hosts lost with every rank on them, for the next recovery to leave out.
        self.lost_hosts: list[str] = []
        #: The ``RankDied`` the current group was torn down for (``None`` while it runs).
        self.death: RankDied | None = None
        #: ``death`` was noticed outside a call, and no call has raised it yet.
        self._unreported = False
        #: One line per engine forker that ended and was replaced, and those of them the
        #: next call has not shown yet.
        self.forker_deaths: list[str] = []
        self._unshown_forker_deaths: list[str] = []
        self._recovering = False

    # ------------------------------------------------------------------ every call

    @contextlib.contextmanager
    def outcome(self, entry: JournalEntry | None) -> Iterator[None]:
        """Record how the call of ``entry`` ended (``None``: a call the journal does not
        keep); with ``recover="auto"``, recover from a death or a wedged collective."""
        pool = self._pool
        try:
            yield
        except BaseException as error:
            if entry is not None:
                pool.journal.finish(entry, outcome_of(error))
                if isinstance(error, RankError):  # the group lives: its notices are read
                    self.take_notices()
            if isinstance(error, RankDied):
                # Kept for the next recovery, called or by itself: it leaves these hosts out.
                self.lost_hosts = list(error.lost_hosts)
            if isinstance(error, Advised):
                self._fit_advice(error)
            if pool.recover_mode == "auto" and not self._recovering and self._wedged_or_dead(error):
                self._recover_by_itself(error)
            raise
        if entry is not None:
            pool.journal.finish(entry, "ok")
            # The snapshots this call took, in its own journal row at once.
            self.take_notices()

    def before_call(self) -> None:
        """What a call checks before it is sent: engine forkers that ended are replaced
        and said so, and ranks that died since the last call raise :class:`RankDied`
        (the call does not run)."""
        self.notice()
        for line in self._unshown_forker_deaths:
            print(f"fsdp-interactive: {line}", file=sys.stderr, flush=True)
        self._unshown_forker_deaths = []
        if self._unreported and self.death is not None:
            self._unreported = False
            # A copy says so: the death itself, as Pool.check() and %fsdp status show it,
            # is about no call.
            raise self.death.with_head_line("This call did not run.")

    def _wedged_or_dead(self, error: BaseException) -> bool:
        if isinstance(error, RankDied):
            return True
        live = self._pool._live
        if isinstance(error, RankTimeout) and live is not None:
            return bool(live.diagnosis.blocked_in_collective(error.pending))
        return False

    def _snapshot_known(self) -> bool:
        return bool(self._pool._snapshot_book.all())

    def _fit_advice(self, error: Advised) -> None:
        """Without any snapshot a recovery cannot work: the message does not name it."""
        if RECOVER in error.advice and not self._snapshot_known():
            error.advise(*(step for step in error.advice if step is not RECOVER))

    def _recover_by_itself(self, error: BaseException) -> None:
        assert isinstance(error, Advised)
        pool = self._pool
        if not self._snapshot_known():
            error.add_note_line("No snapshot was taken, so there was nothing to recover to.")
            return
        what = error.summary if isinstance(error, RankDied) else "ranks blocked in a collective"
        _say(f"{what}; recovering to the last snapshot by itself (recover auto)")
        try:
            with self.recovering():
                report = execute(pool, make_plan(pool, None, None), RecoveryProgress())
        except Exception as failure:
            # Its own advice is in API words; the error's advice stays what to do.
            error.recovery_failed(
                failure.what_happened if isinstance(failure, Advised) else str(failure)
            )
            return
        self.lost_hosts = []
        error.recovered("\n".join([report.summary(), *report.names_lines()]), report.step)
        with self.recovering():  # what the views refresh never recovers again by itself
            pool._recovery_watchers.tell(report)

    @contextlib.contextmanager
    def recovering(self) -> Iterator[None]:
        """While a recovery runs: the calls it makes never start another one by themselves."""
        outer, self._recovering = self._recovering, True
        try:
            yield
        finally:
            self._recovering = outer

    def mark_needs_restart(self) -> None:
        self._pool.needs_restart = True

    # ------------------------------------------------------------------ deaths

    def fail_dead(self, dead: list[int]) -> NoReturn:
        """Report how ranks died and raise ``RankDied``; the survivors are ended and the
        group torn down meanwhile, on a thread."""
        raise self._break(dead, between_calls=False)

    def notice(self) -> PoolHealth:
        """Look for ranks that died and engine forkers that ended since the last look; a
        group that lost a rank is torn down (its ``RankDied`` raised by the next call).
        What was found, as :class:`~._state.PoolHealth`."""
        pool = self._pool
        self._replace_ended_forkers()
        live = pool._live
        if pool._state is PoolState.RUNNING and live is not None:
            dead = live.dead_ranks()
            if dead:
                self._break(dead, between_calls=True)
                self._unreported = True
        return PoolHealth(
            pool._state, pool.world_size, self.death, tuple(self.forker_deaths), self._unreported
        )

    def _break(self, dead: list[int], *, between_calls: bool) -> RankDied:
        """The ``RankDied`` for ``dead``, kept as :attr:`death`; the group is torn down on
        a thread meanwhile."""
        pool = self._pool
        live = pool._live
        assert live is not None
        # Ranks that die together (a host that vanished) are seen one poll apart.
        time.sleep(DEATHS_SETTLE_S)
        self.take_notices()  # whether a snapshot exists decides what the error advises
        dead = sorted(set(dead) | set(live.dead_ranks()))
        error = live.death_error(dead, between_calls=between_calls)
        self._fit_advice(error)
        pool._state = PoolState.BROKEN
        self.death = error

        def clean_up() -> None:
            began = time.monotonic()
            try:
                pool._processes.kill_engines()
                # The forkers stay: a recovery forks the new group from them.
                pool._teardown(keep_forker=True, final_state=PoolState.BROKEN)
            finally:
                log.debug("the broken group was torn down in %.2fs", time.monotonic() - began)

        self._cleanup = threading.Thread(target=clean_up, name="fsdp-interactive-teardown")
        self._cleanup.start()
        return error

    def started(self) -> None:
        """A fresh group runs: no death is left to report."""
        self.death = None
        self._unreported = False

    def finish_cleanup(self) -> None:
        """Wait for the teardown of a group that lost a rank, if one is under way."""
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None and cleanup is not threading.current_thread():
            cleanup.join()

    def _replace_ended_forkers(self) -> None:
        """Start a new engine forker on every host whose forker ended while the pool ran."""
        processes = self._pool._processes
        replaced = processes.forkers.replace_ended(skip=self.lost_hosts)
        for ended in replaced:
            where = f"on {ended.host}" if ended.host else "on this host"
            line = (
                f"the engine forker {where} (pid {ended.pid}) ended "
                f"({describe_exit(ended.status)}); the ranks it forked run on, and a new "
                f"one (pid {ended.new_pid}) forks the next group's engines"
            )
            log.info("%s", line)
            self.forker_deaths.append(line)
            self._unshown_forker_deaths.append(line)
        if replaced:
            processes.record()

    # ------------------------------------------------------------------ notices

    def take_notices(self) -> None:
        """Read what the ranks sent unasked: snapshot records, for the book and journal, and
        each cell's report (what it did, the generators), for the journal."""
        pool = self._pool
        live = pool._live
        if live is None:
            return
        for notice in live.diagnosis.agents.notices():
            if notice.get("kind") == "snapshot" and "id" in notice:
                pool._snapshot_book.add([notice])
                if isinstance(notice.get("held"), list):  # the rest was rotated away
                    pool._snapshot_book.forget(keep=[*notice["held"], notice["id"]])
                pool.journal.note_snapshot(notice.get("call"), str(notice["id"]))
            elif notice.get("kind") == "cell":
                pool.journal.note_cell(notice)
