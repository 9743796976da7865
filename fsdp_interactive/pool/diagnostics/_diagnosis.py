"""What the pool tells about its ranks when a call does not end normally.

Reports, each built from what the ranks' diagnostics agents answer over the network
(:mod:`._agent_client`; local and remote ranks alike, nothing is read from a file):

* stacks (:meth:`Diagnosis.stacks`): every rank's user thread as a traceback with
  source lines (and, on request, py-spy's native frames). A rank whose agent does not
  answer (a thread holds the GIL in C code) is asked through the fallback: the pool
  signals it (:data:`pool.common._agent_wire.STACK_SIGNAL`, through ipyparallel's nanny) and its
  faulthandler writes the stack into the rank's fault link from the C signal handler;
  such stacks say so and carry no source lines except for cell code;
* collectives (:meth:`Diagnosis.trace`): every rank's flight-recorder entries and the
  one-line diagnosis where ranks disagree (:mod:`pool.common._collectives`);
* a timeout (:meth:`Diagnosis.timeout_error`): where every rank is, the diagnosis, the
  last collectives and the stacks of the ranks still running;
* a death (:meth:`Diagnosis.death_error`): exit status of each dead rank, asked of the
  launcher of its engine (:class:`pool.processes._launched.EngineProcess`), for a
  ``SIGKILL`` on this host whether the OOM killer sent it (:mod:`._oom`), and what it
  wrote during the call it died in: the output the kernel received from it and its
  engine log since it took the call, nothing older (:mod:`._death_report`);
* an interrupt (:meth:`Diagnosis.interrupt_error`, :func:`interrupted_on_ranks`): which
  ranks did not stop (and where they are) and whether one was inside
  ``torch.distributed`` (then the group must be restarted).

Not done here: deciding when to report (the waiting in :mod:`._dispatch` does) or acting
on a report (the pool tears down a group that lost a rank).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive.pool.common._agent_wire import STACK_SIGNAL, derive_key
from fsdp_interactive.pool.common._collectives import (
    RecorderDump,
    blocked_where,
    diagnose,
    table_text,
    unfinished_on_device,
    waiting_behind,
)
from fsdp_interactive.pool.common._stacks import (
    Frame,
    describe,
    format_stack,
    user_frames,
    user_stack,
    with_cell_sources,
)
from fsdp_interactive.pool.common._topology import RankRecord
from fsdp_interactive.pool.diagnostics._agent_client import RankAgents
from fsdp_interactive.pool.diagnostics._death_report import (
    CallRecord,
    death_report,
    idle_death_report,
    log_during,
)
from fsdp_interactive.pool.diagnostics._oom import OomRecords
from fsdp_interactive.pool.errors import RankDied, RankInterrupted, RankTimeout, strip_ansi

log = logging.getLogger(__name__)

_SIGNAL_WAIT_S = 3.0
_NATIVE_TIMEOUT_S = 90.0
#: Flight-recorder entries read to find a rank's unfinished NCCL collectives (they are
#: among the newest: a stream runs its collectives in issue order).
_UNFINISHED_TRACE = 256
#: Collectives per group shown in a timeout's message (the recorder keeps more).
_TIMEOUT_TABLE_ROWS = 6

#: ``signal(ranks, signal number)``: how the diagnosis reaches the ranks.
Signaller = Callable[[list[int], int], None]


def traceback_text(exc: BaseException) -> str:
    """Plain text of an exception's traceback: the rank's own for a remote error."""
    remote = getattr(exc, "traceback", None)
    if isinstance(remote, str) and remote:
        return strip_ansi(remote)
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def mentions_distributed(traceback_text: str) -> bool:
    """Whether a traceback passes through ``torch.distributed``."""
    return "torch/distributed/" in traceback_text.replace("\\", "/")


@dataclass(frozen=True)
class StackReport:
    """Every asked rank's stack at one moment.

    ``stacks``: traceback-order text; ``where``: one line each; ``frames``: the parsed
    user frames (innermost first; absent without any answer); ``source``: how each stack
    came (``"agent"``, ``"signal"``, or ``"none"``); ``native``: py-spy's text (or why
    there is none) when native frames were asked for; ``traces``: flight-recorder dumps
    when asked for; ``seconds``: how long each rank took to answer its agent.
    """

    stacks: dict[int, str]
    where: dict[int, str]
    frames: dict[int, list[Frame]]
    source: dict[int, str] = field(default_factory=dict)
    native: dict[int, str] = field(default_factory=dict)
    traces: dict[int, RecorderDump] = field(default_factory=dict)
    seconds: float = 0.0


class Diagnosis:
    """Reports on the ranks of one running group (``records`` in rank order).

    ``agents``: the ranks' diagnostics agents; ``thread_ids``: each rank's user thread
    (to pick its block out of a faulthandler dump); ``signal(ranks, sig)``: how ranks are
    signalled.
    """

    def __init__(
        self,
        records: Sequence[RankRecord],
        *,
        agents: RankAgents,
        thread_ids: Mapping[int, int],
        signal: Signaller,
    ) -> None:
        self._records = list(records)
        self.agents = agents
        self._thread_ids = dict(thread_ids)
        self._signal = signal

    @property
    def ranks(self) -> list[int]:
        """Every rank of the group, in order."""
        return [record.rank for record in self._records]

    @classmethod
    def of_group(cls, group: Any, cluster_key: bytes, *, signal: Signaller) -> Diagnosis:
        """The diagnosis of a group that just formed (a ``pool._rendezvous.Group``), with
        links open to its ranks' agents under the channel key derived from ``cluster_key``
        (the ipyparallel session's) and the group's nonce."""
        agents = RankAgents(group.agents, derive_key(cluster_key, group.nonce))
        agents.open_links()
        return cls(group.records, agents=agents, thread_ids=group.thread_ids, signal=signal)

    def stacks(
        self,
        code: str | None = None,
        ranks: Sequence[int] | None = None,
        *,
        cell: str | None = None,
        native: bool = False,
        trace: int | None = None,
    ) -> StackReport:
        """The current stack of ``ranks`` (default: all), without stopping any.

        ``code``/``cell``: the source and label ("Cell In[15]") of the cell the ranks run,
        to complete fallback stacks; ``native``: add py-spy's frames; ``trace``: also fetch
        the last ``trace`` flight-recorder entries in the same round trip.
        """
        ranks = [r.rank for r in self._records] if ranks is None else list(ranks)
        request: dict[str, Any] = {"op": "stacks", "native": native, "trace": trace}
        began = time.monotonic()
        replies = self.agents.ask(ranks, request, _NATIVE_TIMEOUT_S if native else None)
        seconds = time.monotonic() - began
        report = StackReport({}, {}, {}, seconds=seconds)
        for rank, reply in replies.items():
            user = next((t for t in reply["threads"] if t.user), None)
            frames = user_frames(user.frames) if user is not None else []
            report.frames[rank] = frames
            report.source[rank] = "agent"
            if native:
                report.native[rank] = reply.get("native") or f"({reply.get('native_error')})"
            if reply.get("trace") is not None:
                report.traces[rank] = reply["trace"]
        silent = [rank for rank in ranks if rank not in replies]
        if silent:
            log.debug("ranks %s did not answer their agents; signalling them", silent)
            dumps = self.agents.signal_dumps(
                silent, lambda rs: self._signal(rs, STACK_SIGNAL), _SIGNAL_WAIT_S
            )
            for rank, dump in dumps.items():
                frames = user_stack(dump, self._thread_ids.get(rank))
                report.frames[rank] = with_cell_sources(frames, code, cell)
                report.source[rank] = "signal"
        for rank in ranks:
            if rank not in report.frames:
                report.source[rank] = "none"
                report.stacks[rank] = (
                    f"(no stack: rank {rank} answered neither its diagnostics agent nor the "
                    "stack signal)"
                )
                report.where[rank] = "unknown: no answer from the rank"
                continue
            frames = report.frames[rank]
            text = format_stack(frames) if frames else "  (idle: no user code running)"
            if report.source[rank] == "signal":
                text = (
                    "  (from the stack signal: the rank's agent did not answer, so a thread "
                    "may hold the GIL; no source lines outside the cell)\n" + text
                )
            report.stacks[rank] = text
            report.where[rank] = describe(frames, code)
        return report

    def trace(
        self, ranks: Sequence[int] | None = None, last: int | None = None, issued_at: bool = False
    ) -> dict[int, Any]:
        """Every asked rank's flight-recorder dump (ranks that did not answer are missing)."""
        ranks = [r.rank for r in self._records] if ranks is None else list(ranks)
        request = {"op": "trace", "last": last, "issued_at": issued_at}
        replies = self.agents.ask(ranks, request, _NATIVE_TIMEOUT_S if issued_at else None)
        return {rank: reply["trace"] for rank, reply in replies.items()}

    def timeout_error(
        self,
        pending: list[int],
        limit: str,
        code: str | None,
        wait: Callable[[float | None], Any],
        *,
        cell: str | None = None,
        native: bool = False,
        targets: Sequence[int] | None = None,
    ) -> RankTimeout:
        """The error for a call whose ``pending`` ranks did not finish within ``limit``."""
        began = time.monotonic()
        report = self.stacks(code=code, cell=cell, native=native, trace=64)
        where = dict(report.where)
        for rank in pending:
            blocked = blocked_where(report.frames.get(rank, []), report.traces.get(rank), code)
            if blocked is not None:
                where[rank] = blocked
        targeted = set(targets) if targets is not None else set(where)
        finished = [rank for rank in where if rank not in pending and rank in targeted]
        for rank in where:
            if rank not in pending:
                state = "finished this run" if rank in targeted else "not part of this run"
                where[rank] = (
                    f"{state}; {'idle' if where[rank].startswith('idle') else 'now ' + where[rank]}"
                )
        lines = [
            f"ranks {pending} did not finish within {limit}; they are still running:"
            if len(pending) > 1
            else f"rank {pending[0]} did not finish within {limit}; it is still running:"
        ]
        lines += [f"  rank {r}: {where[r]}" for r in sorted(where)]
        findings = diagnose(report.traces, finished, {r: where[r] for r in pending if r in where})
        lines += [f"collectives: {finding}" for finding in findings]
        tail = []
        for rank in pending:
            tail.append(f"--- rank {rank} stack (most recent call last) ---\n{report.stacks[rank]}")
            if native:
                tail.append(
                    f"--- rank {rank} native stack (py-spy) ---\n{report.native.get(rank, '')}"
                )
        table = table_text(report.traces, last=_TIMEOUT_TABLE_ROWS)
        if table:
            tail.append("--- last collectives of every rank (flight recorder) ---\n" + table)
        log.debug("timeout report built in %.3fs", time.monotonic() - began)
        return RankTimeout(
            "\n".join(lines),
            "\n".join(tail),
            report.stacks,
            where,
            pending,
            wait,
            collectives=report.traces,
            diagnosis=findings,
            native=report.native,
        )

    def death_error(
        self,
        dead: list[int],
        engine_of: Callable[[int], Any],
        during: Mapping[int, CallRecord] | None = None,
        *,
        between_calls: bool = False,
        oom: OomRecords | None = None,
    ) -> RankDied:
        """The error for ranks ``dead``; ``engine_of(pid)`` gives the
        :class:`pool.processes._launched.EngineProcess` of a pid (``None``: not started by the pool,
        whose exit status is then unknown); ``during`` maps the ranks of the call that saw
        the deaths to their part of it (a dead rank missing there was not part of it);
        ``between_calls``: the ranks died while no call ran (only a crash report in their
        engine log is shown); ``oom``: the OOM records of the group's ranks on this host,
        which say whether a rank killed by ``SIGKILL`` was out of memory."""
        records = {r.rank: r for r in self._records}
        calls = during or {}
        tails: dict[int, str] = {}
        reports: dict[int, str] = {}
        codes: dict[int, int | None] = {}
        for rank in dead:
            engine = engine_of(records[rank].pid)
            record = calls.get(rank)
            logged = log_during(
                engine.output() if engine is not None else "",
                record.request if record is not None else None,
            )
            tails[rank] = logged.text
            report = idle_death_report(rank, logged) if between_calls else None
            reports[rank] = death_report(rank, record, logged) if report is None else report
            codes[rank] = engine.exit_code() if engine is not None else None
        causes = oom.explain(codes) if oom is not None else {}
        log.debug("ranks %s died; exit statuses %s %s", dead, codes, causes)
        hosts = {r.host for r in self._records}
        lost_hosts = []
        if len(hosts) > 1:
            for host in sorted(hosts):
                on_host = [r.rank for r in self._records if r.host == host]
                if all(rank in dead and codes[rank] is None for rank in on_host):
                    lost_hosts.append(host)
        return RankDied(
            dead,
            codes,
            tails,
            hosts={rank: records[rank].host for rank in dead},
            pids={rank: records[rank].pid for rank in dead},
            lost_hosts=lost_hosts,
            reports=reports,
            between_calls=between_calls,
            causes=causes,
        )

    def blocked_in_collective(
        self, ranks: Sequence[int], code: str | None = None
    ) -> dict[int, str]:
        """Those of ``ranks`` that are blocked in a collective, with where they are: inside
        ``torch.distributed``, or waiting for the GPU behind an NCCL collective that has
        not completed (:func:`pool.common._collectives.blocked_where`)."""
        if not ranks:
            return {}
        report = self.stacks(code=code, ranks=ranks, trace=_UNFINISHED_TRACE)
        blocked = {}
        for rank in ranks:
            where = blocked_where(report.frames.get(rank, []), report.traces.get(rank), code)
            if where is not None:
                blocked[rank] = where
        return blocked

    def unfinished_collectives(self, ranks: Sequence[int]) -> dict[int, str]:
        """Those of ``ranks`` whose NCCL recorder holds a collective that has not completed
        on the GPU (the oldest, described): a rank that stopped its Python code (an
        interrupt, an error) leaves it queued there, and its group must be restarted."""
        if not ranks:
            return {}
        dumps = self.trace(ranks, last=_UNFINISHED_TRACE)
        found = {}
        for rank, dump in dumps.items():
            behind = unfinished_on_device(dump)
            if behind:
                found[rank] = waiting_behind(behind[0])
        return found

    def interrupt_error(
        self, signalled: list[int], handles: Mapping[int, Any], code: str | None
    ) -> RankInterrupted:
        """The error for a call whose ``signalled`` ranks got SIGINT: which ranks did not
        stop (and where they are) and which were inside a collective (``torch.distributed``
        or, for NCCL, one still unfinished on the GPU): then the group must be restarted."""
        stuck_ranks = [rank for rank, handle in handles.items() if not handle.ready()]
        stuck: dict[int, str] = {}
        in_collective: list[int] = []
        if stuck_ranks:
            report = self.stacks(code=code, ranks=stuck_ranks, trace=_UNFINISHED_TRACE)
            stuck = {rank: report.where[rank] for rank in stuck_ranks}
            for rank in stuck_ranks:
                where = blocked_where(report.frames.get(rank, []), report.traces.get(rank), code)
                if where is not None:
                    stuck[rank] = where
                    in_collective.append(rank)
        stopped = []
        for rank, handle in handles.items():
            if rank in stuck_ranks:
                continue
            stopped.append(rank)
            exc = _exception_of(handle)
            if exc is not None and mentions_distributed(traceback_text(exc)):
                in_collective.append(rank)
        left_behind = self.unfinished_collectives([r for r in stopped if r not in in_collective])
        in_collective += list(left_behind)
        log.debug(
            "interrupt: ranks %s did not stop; inside a collective: %s",
            stuck_ranks,
            in_collective,
        )
        return RankInterrupted(signalled, stuck, sorted(set(in_collective)), left_behind)

    def close(self) -> None:
        self.agents.close()


def interrupted_on_ranks(
    tracebacks: Mapping[int, str], unfinished: Mapping[int, str] | None = None
) -> RankInterrupted:
    """The error for ranks that all raised KeyboardInterrupt (SIGINT reached them from
    ``pool.interrupt()`` or elsewhere while the call was awaited); ``unfinished``: ranks
    that left an NCCL collective unfinished on the GPU
    (:meth:`Diagnosis.unfinished_collectives`)."""
    unfinished = dict(unfinished or {})
    in_collective = [rank for rank, text in tracebacks.items() if mentions_distributed(text)]
    in_collective += [rank for rank in unfinished if rank not in in_collective]
    return RankInterrupted(sorted(tracebacks), {}, sorted(in_collective), unfinished)


def _exception_of(handle: Any) -> BaseException | None:
    """The exception a finished call raised on its rank (``None``: it succeeded)."""
    try:
        handle.get(0)
    except Exception as exc:
        return exc
    return None
