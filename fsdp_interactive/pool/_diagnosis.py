"""What the pool tells about its ranks when a call does not end normally.

Four reports, each an exception of :mod:`.errors` built here:

* stacks (:meth:`Diagnosis.stacks`): each rank registered ``faulthandler`` on
  :data:`~._rank_bootstrap.STACK_SIGNAL`, writing to a per-rank file
  (:class:`StackFiles`); the pool sends the signal through ipyparallel's nanny and reads
  what was appended. The dump is written from the C signal handler, so it works while a
  rank's main thread is blocked inside a C++ collective, and nothing is interrupted.
  :mod:`._stacks` parses the text.
* a timeout (:meth:`Diagnosis.timeout_error`): where every rank is, and the stacks of
  the ranks still running;
* a death (:meth:`Diagnosis.death_error`): exit status and last output lines of each
  dead rank, asked of the launcher of its engine (:class:`~._processes.EngineProcess`);
* an interrupt (:meth:`Diagnosis.interrupt_error`, :func:`interrupted_on_ranks`): which
  ranks did not stop and where they are, and whether one was inside
  ``torch.distributed`` (then the group must be restarted).

Not done here: deciding when to report (the waiting in :mod:`._dispatch` does) or acting
on a report (the pool tears down a group that lost a rank). Stack files of ranks on
other hosts stay there; their path is reported instead of their stack.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.pool._rank_bootstrap import STACK_SIGNAL
from fsdp_interactive.pool._stacks import Frame, describe, format_stack, in_distributed, user_stack
from fsdp_interactive.pool._topology import RankRecord
from fsdp_interactive.pool.errors import RankDied, RankInterrupted, RankTimeout, strip_ansi

log = logging.getLogger(__name__)

_POLL_S = 0.05
_STACK_WAIT_S = 3.0

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
    """Every rank's stack at one moment: ``stacks`` (traceback order), ``where`` (one
    line each) and the parsed user ``frames`` (innermost first; absent without a dump)."""

    stacks: dict[int, str]
    where: dict[int, str]
    frames: dict[int, list[Frame]]


class StackFiles:
    """The per-rank files ranks append their stack dumps to, read from this host."""

    def __init__(self, paths: Mapping[int, str], hosts: Mapping[int, str]) -> None:
        self._paths = dict(paths)
        self._hosts = dict(hosts)
        self._local = socket.gethostname()

    def readable(self, rank: int) -> bool:
        return self._hosts[rank] == self._local

    def location(self, rank: int) -> str:
        return f"{self._hosts[rank]}:{self._paths[rank]}"

    def sizes(self, ranks: Sequence[int]) -> dict[int, int]:
        """Current size of each rank's file, to read only what is appended after."""
        return {rank: _size(self._paths[rank]) for rank in ranks}

    def read_appended(
        self, sizes: Mapping[int, int], wait_s: float = _STACK_WAIT_S
    ) -> dict[int, str]:
        """What each readable rank appended beyond ``sizes``, waiting up to ``wait_s``."""
        wanted = [rank for rank in sizes if self.readable(rank)]
        dumps: dict[int, str] = {}
        end = time.monotonic() + wait_s
        while len(dumps) < len(wanted) and time.monotonic() < end:
            for rank in wanted:
                path = self._paths[rank]
                if rank not in dumps and _size(path) > sizes[rank]:
                    time.sleep(_POLL_S)  # let the signal handler finish writing
                    with open(path) as f:
                        f.seek(sizes[rank])
                        dumps[rank] = f.read()
            if len(dumps) < len(wanted):
                time.sleep(_POLL_S)
        return dumps


class Diagnosis:
    """Reports on the ranks of one running group (``records`` in rank order)."""

    def __init__(
        self,
        records: Sequence[RankRecord],
        *,
        thread_ids: Mapping[int, int],
        stack_files: StackFiles,
        signal: Signaller,
    ) -> None:
        self._records = list(records)
        self._thread_ids = dict(thread_ids)
        self._files = stack_files
        self._signal = signal

    def stacks(self, code: str | None = None, ranks: Sequence[int] | None = None) -> StackReport:
        """The current Python stack of ``ranks`` (default: all), without stopping any.

        ``code``: the cell source sent to the ranks, to quote the line a rank is on.
        """
        ranks = [r.rank for r in self._records] if ranks is None else list(ranks)
        sizes = self._files.sizes(ranks)
        self._signal(ranks, STACK_SIGNAL)
        dumps = self._files.read_appended(sizes)
        log.debug("stack dumps asked of ranks %s, received from %s", ranks, sorted(dumps))
        stacks: dict[int, str] = {}
        where: dict[int, str] = {}
        frames: dict[int, list[Frame]] = {}
        for rank in ranks:
            if rank in dumps:
                frames[rank] = user_stack(dumps[rank], self._thread_ids.get(rank))
                stacks[rank] = format_stack(frames[rank])
                where[rank] = describe(frames[rank], code)
            else:
                stacks[rank] = f"(stack written on {self._files.location(rank)})"
                where[rank] = "unknown: no stack dump received"
        return StackReport(stacks, where, frames)

    def timeout_error(
        self,
        pending: list[int],
        limit: str,
        code: str | None,
        wait: Callable[[float | None], Any],
    ) -> RankTimeout:
        """The error for a call whose ``pending`` ranks did not finish within ``limit``."""
        report = self.stacks(code=code)
        where = dict(report.where)
        for rank in where:
            if rank not in pending:
                where[rank] = "finished this run; now " + where[rank]
        lines = [
            f"ranks {pending} did not finish within {limit}; they are still running:"
            if len(pending) > 1
            else f"rank {pending[0]} did not finish within {limit}; it is still running:"
        ]
        lines += [f"  rank {r}: {where[r]}" for r in sorted(where)]
        lines.append(
            "Keep waiting with err.wait(), interrupt with pool.interrupt(), "
            "or start a fresh group with pool.restart()."
        )
        for rank in pending:
            lines.append(
                f"--- rank {rank} stack (most recent call last) ---\n{report.stacks[rank]}"
            )
        return RankTimeout("\n".join(lines), report.stacks, where, pending, wait)

    def death_error(self, dead: list[int], engine_of: Callable[[int], Any]) -> RankDied:
        """The error for ranks ``dead``; ``engine_of(pid)`` gives the
        :class:`~._processes.EngineProcess` of a pid (``None``: not started by the pool,
        whose exit status is then unknown)."""
        records = {r.rank: r for r in self._records}
        tails: dict[int, str] = {}
        codes: dict[int, int | None] = {}
        for rank in dead:
            engine = engine_of(records[rank].pid)
            tails[rank] = engine.output_tail() if engine is not None else ""
            codes[rank] = engine.exit_code() if engine is not None else None
        log.debug("ranks %s died; exit statuses %s", dead, codes)
        return RankDied(
            dead,
            codes,
            tails,
            hosts={rank: records[rank].host for rank in dead},
            pids={rank: records[rank].pid for rank in dead},
        )

    def interrupt_error(
        self, signalled: list[int], handles: Mapping[int, Any], code: str | None
    ) -> RankInterrupted:
        """The error for a call whose ``signalled`` ranks got SIGINT: which ranks did not
        stop (and where they are) and which were inside ``torch.distributed``."""
        stuck_ranks = [rank for rank, handle in handles.items() if not handle.ready()]
        stuck: dict[int, str] = {}
        in_collective: list[int] = []
        if stuck_ranks:
            report = self.stacks(code=code, ranks=stuck_ranks)
            stuck = {rank: report.where[rank] for rank in stuck_ranks}
            in_collective += [
                rank
                for rank in stuck_ranks
                if in_distributed(report.frames.get(rank, [])) is not None
            ]
        for rank, handle in handles.items():
            if rank in stuck_ranks:
                continue
            exc = _exception_of(handle)
            if exc is not None and mentions_distributed(traceback_text(exc)):
                in_collective.append(rank)
        log.debug(
            "interrupt: ranks %s did not stop; inside torch.distributed: %s",
            stuck_ranks,
            in_collective,
        )
        return RankInterrupted(signalled, stuck, sorted(set(in_collective)))


def interrupted_on_ranks(tracebacks: Mapping[int, str]) -> RankInterrupted:
    """The error for ranks that all raised KeyboardInterrupt (SIGINT reached them from
    ``pool.interrupt()`` or elsewhere while the call was awaited)."""
    in_collective = [rank for rank, text in tracebacks.items() if mentions_distributed(text)]
    return RankInterrupted(sorted(tracebacks), {}, in_collective)


def _exception_of(handle: Any) -> BaseException | None:
    """The exception a finished call raised on its rank (``None``: it succeeded)."""
    try:
        handle.get(0)
    except Exception as exc:
        return exc
    return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
