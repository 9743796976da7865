"""The parts of a pool that exist while its process group runs.

A :class:`LiveGroup` is made once a pool's group has formed and dropped when the group is
torn down. It holds the ipyparallel client, the formed group (a record and a view per
rank, :class:`~._rendezvous.Group`), the :class:`Diagnosis` of its ranks and the calls
that still run on them (:class:`~._dispatch.Unfinished`), and it is what sends a call
(:meth:`LiveGroup.views`, :meth:`LiveGroup.pending`), tells which ranks died
(:meth:`LiveGroup.dead_ranks`: asked while a call waits, and before every call) and
signals ranks (:meth:`LiveGroup.signal`).

Faults: a group that lost a rank cannot take it back, so a dead rank makes the whole
LiveGroup unusable; the pool closes it (:meth:`LiveGroup.close`) and a later start makes
a new one. Not done here: the pool's states, and starting or ending processes (the pool's
:class:`~pool.processes._launched.LaunchedProcesses` does both).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from fsdp_interactive.pool._dispatch import (
    PendingCall,
    RankWatch,
    Unfinished,
    dead_ranks,
    purge_results,
    signal_ranks,
)
from fsdp_interactive.pool._rendezvous import Group, leave_group
from fsdp_interactive.pool.common._collectives import CollectiveTrace, diagnose
from fsdp_interactive.pool.common._topology import RankRecord
from fsdp_interactive.pool.diagnostics._death_report import CallRecord
from fsdp_interactive.pool.diagnostics._diagnosis import Diagnosis
from fsdp_interactive.pool.diagnostics._interrupt import InterruptReport, settle
from fsdp_interactive.pool.diagnostics._oom import OomRecords
from fsdp_interactive.pool.errors import RankDied
from fsdp_interactive.pool.processes._launched import LaunchedProcesses

log = logging.getLogger(__name__)


class LiveGroup:
    """One formed group of a pool: ``client`` (ipyparallel's), ``group`` (as the
    rendezvous formed it), ``processes`` (what the pool launched, to find a rank's engine
    process; empty for a cluster it connected to) and ``owned`` (the pool started these
    engines: closing ends nothing but the links; a connected pool's ranks leave the group).

    The links to the ranks' diagnostics agents open here; :meth:`close` closes them.
    """

    def __init__(
        self, client: Any, group: Group, processes: LaunchedProcesses, *, owned: bool
    ) -> None:
        self.client = client
        self.group = group
        self._processes = processes
        self._owned = owned
        self.unfinished = Unfinished()
        self._dying_call: dict[int, CallRecord] = {}
        self.diagnosis = Diagnosis.of_group(group, client.session.key, signal=self.signal)
        self._oom = OomRecords(self._local_pids())

    def _local_pids(self) -> dict[int, int]:
        """rank -> pid of the ranks whose processes run on this host (the pool started them
        here: their start times were recorded)."""
        local = {}
        for record in self.group.records:
            engine = self._processes.engine(record.pid)
            if engine is not None and engine.created is not None:
                local[record.rank] = record.pid
        return local

    @property
    def records(self) -> list[RankRecord]:
        return self.group.records

    @property
    def world_size(self) -> int:
        return len(self.group.records)

    def views(self, ranks: Sequence[int]) -> dict[int, Any]:
        """One single-engine view per rank of ``ranks``, for a new call."""
        self.unfinished.refuse_if_busy()
        return {rank: self.group.views[rank] for rank in ranks}

    def pending(
        self,
        handles: dict[int, Any],
        *,
        fail_dead: Callable[[list[int]], NoReturn],
        needs_restart: Callable[[], None],
        interrupt_grace: float,
        **options: Any,
    ) -> PendingCall:
        """The call whose per-rank handles are ``handles``, to be waited for; a death seen
        while waiting goes to ``fail_dead(ranks)``, an interrupt that leaves ranks inside
        torch.distributed to ``needs_restart()``."""
        watch = RankWatch(
            dead_ranks=self.dead_ranks,
            fail_dead=fail_dead,
            note_call=self._note_call,
            signal=self.signal,
            diagnosis=self.diagnosis,
            unfinished=self.unfinished,
            needs_restart=needs_restart,
            purge=functools.partial(purge_results, self.client),
            interrupt_grace=interrupt_grace,
        )
        return PendingCall(handles, watch=watch, **options)

    def stacks(
        self, code: str | None = None, *, native: bool = False
    ) -> tuple[dict[int, str], dict[int, str]]:
        """``(stacks, where)`` of every rank, as ``Pool.stacks`` returns them."""
        report = self.diagnosis.stacks(code=code, native=native)
        stacks = dict(report.stacks)
        if native:
            for rank, text in report.native.items():
                stacks[rank] += f"\n--- native stack (py-spy) ---\n{text}"
        return stacks, report.where

    def trace(self, ranks: list[int], last: int, *, issued_at: bool) -> CollectiveTrace:
        """The recent collectives of ``ranks`` and where they disagree (ranks that still run
        an unfinished call are not expected to have finished their last collective)."""
        dumps = self.diagnosis.trace(ranks, issued_at=issued_at)
        busy = set(self.unfinished.busy_ranks())
        findings = diagnose(dumps, finished=[r for r in ranks if r not in busy])
        silent = [rank for rank in ranks if rank not in dumps]
        if silent:
            findings.append(f"no answer from the agents of ranks {silent}")
        return CollectiveTrace(dumps, findings, last)

    def interrupt(self, ranks: list[int], grace: float) -> InterruptReport:
        """SIGINT to ``ranks``; wait up to ``grace`` seconds for those that run an unfinished
        call to stop, and report. Ranks left blocked in a collective are remembered as
        such (new calls are refused naming them)."""
        busy = [rank for rank in self.unfinished.busy_ranks() if rank in ranks]
        log.debug("interrupt: SIGINT to ranks %s (busy: %s)", ranks, busy)
        self.signal(ranks, signal.SIGINT)
        if not busy:
            return InterruptReport(signalled=ranks, idle=ranks)
        report = settle(ranks, busy, self.unfinished.busy_ranks, self.diagnosis, grace)
        self.unfinished.blocked |= set(report.blocked)
        return report

    def dead_ranks(self) -> list[int]:
        """Ranks whose process is gone: as the controller and the engines' launchers tell,
        and ranks whose diagnostics link closed (the link closes the moment its process
        ends, on any host; the controller hears of a host that vanished only at its
        heartbeat timeout)."""
        dead = set(dead_ranks(self.client, self.records, self._processes.engine))
        lost = self.diagnosis.agents.lost()
        if lost:
            log.debug("ranks %s: their diagnostics links closed", lost)
        return sorted(dead | set(lost))

    def _note_call(self, records: Mapping[int, CallRecord]) -> None:
        self._dying_call = dict(records)

    def death_error(self, dead: list[int], *, between_calls: bool = False) -> RankDied:
        """The :class:`~.errors.RankDied` that reports how ``dead`` ended, and what each
        wrote during the call that saw the deaths (noted by that call's wait);
        ``between_calls``: no call ran when they died."""
        during = {} if between_calls else self._dying_call
        return self.diagnosis.death_error(
            dead, self._processes.engine, during, between_calls=between_calls, oom=self._oom
        )

    def signal(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to ``ranks`` (through ipyparallel's nannies, else the launchers)."""
        if ranks:
            signal_ranks(self.client, self.records, ranks, sig, self._processes.engine)

    def close(self) -> None:
        """Close the diagnostics links; a connected pool's ranks leave the group. The
        client is the pool's to close."""
        if not self._owned and self.records:
            with contextlib.suppress(Exception):
                leave_group(self.client, self.records)
        self.diagnosis.close()
        self.unfinished.clear()
