"""What a pool does when a call ends badly, and what the ranks tell it unasked.

:class:`PoolFaults` is part of a :class:`~._pool.Pool`:

* :meth:`~PoolFaults.outcome` wraps every call: it records how a ``run`` ended in its
  journal entry and, with ``Pool(recover="auto")``, recovers from a dead rank or a
  collective the ranks are blocked in (:mod:`._recovery`), then lets the call's error go
  on with what was restored added to its message;
* :meth:`~PoolFaults.fail_dead` is how a waiting call reports dead ranks: the error is
  built at once, and the group is torn down on a thread (with remote engines that takes
  ssh round trips) that every later start, stop, restart or recovery waits for first;
* :meth:`~PoolFaults.take_notices` reads the notices the ranks sent (snapshot records)
  into the pool's snapshot book and journal; it runs before a group's links close, so a
  notice sent just before a rank died is kept.

Hosts whose every rank vanished at once (a ``RankDied`` naming lost hosts) are kept in
:attr:`~PoolFaults.lost_hosts` until a recovery leaves them out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from fsdp_interactive.pool._journal import JournalEntry, outcome_of
from fsdp_interactive.pool._recovery import execute, make_plan
from fsdp_interactive.pool._state import PoolState
from fsdp_interactive.pool.errors import Advised, RankDied, RankTimeout

#: A :class:`~._pool.Pool` (not imported: the pool imports this module).
Pool = Any

log = logging.getLogger(__name__)

#: Seconds to wait, after a rank died, for the deaths that come with it.
DEATHS_SETTLE_S = 0.5


class PoolFaults:
    """The fault handling of ``pool``."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._cleanup: threading.Thread | None = None
        #: Hosts lost with every rank on them, for the next recovery to leave out.
        self.lost_hosts: list[str] = []

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
            if isinstance(error, RankDied):
                # Kept for the next recovery, called or by itself: it leaves these hosts out.
                self.lost_hosts = list(error.lost_hosts)
            if pool.recover_mode == "auto" and self._wedged_or_dead(error):
                self._recover_by_itself(error)
            raise
        if entry is not None:
            pool.journal.finish(entry, "ok")

    def _wedged_or_dead(self, error: BaseException) -> bool:
        if isinstance(error, RankDied):
            return True
        live = self._pool._live
        if isinstance(error, RankTimeout) and live is not None:
            return bool(live.diagnosis.blocked_in_collective(error.pending))
        return False

    def _recover_by_itself(self, error: BaseException) -> None:
        assert isinstance(error, Advised)
        pool = self._pool
        try:
            report = execute(pool, make_plan(pool, None, None), say=log.info)
        except Exception as failure:
            error.recovery_failed(str(failure))
            return
        self.lost_hosts = []
        error.recovered(report.summary())

    def mark_needs_restart(self) -> None:
        self._pool.needs_restart = True

    # ------------------------------------------------------------------ deaths

    def fail_dead(self, dead: list[int]) -> NoReturn:
        """Report how ranks died and raise ``RankDied``; the survivors are ended and the
        group torn down meanwhile, on a thread."""
        pool = self._pool
        live = pool._live
        assert live is not None
        # Ranks that die together (a host that vanished) are seen one poll apart.
        time.sleep(DEATHS_SETTLE_S)
        error = live.death_error(sorted(set(dead) | set(live.dead_ranks())))
        pool._state = PoolState.BROKEN

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
        raise error

    def finish_cleanup(self) -> None:
        """Wait for the teardown of a group that lost a rank, if one is under way."""
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None and cleanup is not threading.current_thread():
            cleanup.join()

    # ------------------------------------------------------------------ notices

    def take_notices(self) -> None:
        """Read what the ranks sent unasked: snapshot records, for the book and journal, and
        each cell's report (what it did, the generators), for the journal."""
        pool = self._pool
        if pool._live is None:
            return
        for notice in pool._live.diagnosis.agents.notices():
            if notice.get("kind") == "snapshot" and "id" in notice:
                pool._snapshot_book.add([notice])
                if isinstance(notice.get("held"), list):  # the rest was rotated away
                    pool._snapshot_book.forget(keep=[*notice["held"], notice["id"]])
                pool.journal.note_snapshot(notice.get("call"), str(notice["id"]))
            elif notice.get("kind") == "cell":
                pool.journal.note_cell(notice)
