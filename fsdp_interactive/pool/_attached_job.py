"""``AttachedJob``: a running job's ranks, seen and steered from the notebook like a pool.

:func:`attach` finds the job (:mod:`._attach_find`), links to every rank
(:mod:`._attach_links`) and opens this notebook's session on each. Without pausing the job,
:meth:`AttachedJob.status` tells every rank's host, pid, step, phase (forward, backward,
optimizer, in collective N, outside training) and memory; :meth:`~AttachedJob.stacks` and
:meth:`~AttachedJob.trace` answer as a pool's do; :meth:`~AttachedJob.hang_report` says
which ranks have waited in a collective past a threshold, and why (the flight recorder's
diagnosis and their stacks).

:meth:`~AttachedJob.pause` stops every rank after the same optimizer step: it reads each
rank's step count, asks every rank to pause after the step after the furthest one (or
``at_step``), and asks again, one step further, while some rank had already passed it
(ranks of a job are at most a step apart: their collectives hold them together). While
paused, :meth:`~AttachedJob.run`, ``call``, ``push`` and ``pull`` run on the ranks'
training threads with the pool's signatures, so :class:`~fsdp_interactive.notebook.RankModel`'s
views, ``%%fsdp`` cells, ``%fsdp pull``, snapshots and ``checkpoint.save`` work on the
job's model as they do on a pool's. :meth:`~AttachedJob.resume` lets the job go on;
:meth:`~AttachedJob.detach` (also ``stop()``) resumes it and leaves, the job then running
as if never attached.

Faults: a rank that dies is reported by every call after (:class:`JobRanksGone`), the job's
own failure handling untouched; a notebook that goes away leaves a paused job paused for the
job's ``pause_timeout``, then it resumes by itself; another notebook that takes the job over
ends this one's session (its calls then say so).
"""

from __future__ import annotations

import dataclasses
import getpass
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive.pool._attach_errors import (
    ATTACH,
    DETACH,
    AttachError,
    JobError,
    JobNotPaused,
    JobRanksGone,
)
from fsdp_interactive.pool._attach_find import find_job
from fsdp_interactive.pool._attach_links import JobLinks
from fsdp_interactive.pool._dispatch import Targets, resolve_targets
from fsdp_interactive.pool._output import OutputSink, RunResult
from fsdp_interactive.pool._snapshots import SnapshotBook, SnapshotInfo
from fsdp_interactive.pool.common._collectives import CollectiveTrace, diagnose
from fsdp_interactive.pool.common._job_status import (
    RankState,
    hang_lines,
    status_text,
    waiting_ranks,
)
from fsdp_interactive.pool.common._snapshot_root import new_key
from fsdp_interactive.pool.common._topology import RankRecord
from fsdp_interactive.pool.diagnostics._diagnosis import Diagnosis
from fsdp_interactive.pool.errors import RankError

log = logging.getLogger(__name__)

#: A cell without a timeout waits this long at most (a week: no limit in practice).
_NO_LIMIT_S = 7 * 24 * 3600.0
#: Default seconds in a collective after which ranks count as hung.
DEFAULT_HANG_AFTER_S = 60.0


@dataclass(frozen=True)
class JobStatus:
    """Every rank's state at one moment (``states``), the ranks that did not answer and
    why (``gone``), and the hang report's lines when ranks waited in a collective for
    ``hang_after`` seconds or more (``hang``)."""

    job: str
    states: dict[int, RankState]
    gone: dict[int, str] = field(default_factory=dict)
    hang: list[str] = field(default_factory=list)
    paused_step: int | None = None

    def lines(self, notebook: bool = False) -> list[str]:
        """The status as lines: a head, the table, the hang (what to type next as magics
        with ``notebook``, as API calls without)."""
        ranks = len(self.states) + len(self.gone)
        head = f"job {self.job}: {ranks} ranks, " + (
            f"paused after step {self.paused_step}" if self.paused_step is not None else "running"
        )
        lines = [head, status_text(list(self.states.values()), self.gone)]
        if self.hang:
            lines += ["", "hang:", *(f"  {line}" for line in self.hang)]
            lines.append(
                "  compare the ranks' collectives with "
                + ("%fsdp trace" if notebook else "job.trace()")
                + " and their stacks with "
                + ("%fsdp stacks" if notebook else "job.stacks()")
            )
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass(frozen=True)
class HangReport:
    """Ranks that waited in a collective past the threshold: ``lines`` (who waits where,
    and where the others are), ``findings`` (the flight recorder's diagnosis: which rank
    is behind) and the ``stacks`` of every rank."""

    lines: list[str]
    findings: list[str]
    stacks: dict[int, str]

    def __str__(self) -> str:
        parts = [*self.lines, *(f"collectives: {f}" for f in self.findings)]
        for rank, text in sorted(self.stacks.items()):
            parts.append(f"--- rank {rank} stack (most recent call last) ---\n{text}")
        return "\n".join(parts)


class AttachedJob:
    """A job attached from this kernel (see the module); made by :func:`attach`."""

    #: What the magics read: an attached job is not a pool they started.
    attached = True

    def __init__(
        self,
        links: JobLinks,
        states: Mapping[int, RankState],
        *,
        session: str,
        hang_after: float,
    ):
        self._links = links
        self.job = links.job
        self.hang_after = float(hang_after)
        self._session = session
        self._detached = False
        self._paused_step: int | None = None
        self._pending_step: int | None = None
        self._snapshot_book = SnapshotBook()
        self._records = [
            RankRecord(
                rank=record.rank,
                local_rank=record.local_rank,
                world_size=record.world_size,
                host=record.host,
                pid=record.pid,
                device=states[record.rank].device if record.rank in states else "?",
                backend=states[record.rank].backend if record.rank in states else "?",
                engine_id=-1,
                address=str(links.agents.addresses[record.rank]),
            )
            for record in links.records.values()
        ]
        self._diagnosis = Diagnosis(
            self._records, agents=links.agents, thread_ids={}, signal=_no_signal
        )
        paused = [s for s in states.values() if s.phase == "paused"]
        if paused and len(paused) == len(states) and len({s.step for s in paused}) == 1:
            # Left paused by a notebook that went away: this one's pause now.
            self._paused_step = paused[0].step

    # ------------------------------------------------------------------ what a pool has

    @property
    def state(self) -> str:
        """``"paused"``, ``"attached"`` (the job runs) or ``"detached"``."""
        if self._detached:
            return "detached"
        return "paused" if self._paused_step is not None else "attached"

    @property
    def running(self) -> bool:
        """True while attached (the magics' calls reach the job)."""
        return not self._detached

    @property
    def topology(self) -> list[RankRecord]:
        return list(self._records) if not self._detached else []

    @property
    def world_size(self) -> int:
        return len(self.topology)

    @property
    def paused_step(self) -> int | None:
        """The step every rank is paused after, else ``None``."""
        return self._paused_step

    def snapshots(self) -> list[SnapshotInfo]:
        """The snapshots taken while attached, as rank 0 reported them (oldest first)."""
        self._snapshot_book.add(self._links.take_notices())
        return self._snapshot_book.all()

    def __repr__(self) -> str:
        return f"<AttachedJob {self.job} {self.state} world_size={len(self._records)}>"

    # ------------------------------------------------------------------ without pausing

    def _live(self) -> None:
        if self._detached:
            raise JobError(f"this notebook detached from job {self.job}", ATTACH)
        gone = self._links.gone()
        if not gone:
            return
        if set(gone.values()) == {"taken over"}:
            raise JobError(f"another notebook took job {self.job} over", ATTACH)
        hosts = {r.rank: r.host for r in self._records}
        exited = [r for r, why in gone.items() if why == "exited"]
        died = [r for r, why in gone.items() if why == "died"]
        raise JobRanksGone(self.job, exited, died, hosts)

    def status(self, hang_after: float | None = None) -> JobStatus:
        """Every rank's state (see :class:`JobStatus`), without pausing; ranks that are
        gone are listed as such (never raises for them)."""
        if self._detached:
            raise JobError(f"this notebook detached from job {self.job}", ATTACH)
        threshold = self.hang_after if hang_after is None else float(hang_after)
        replies, _ = self._links.ask(self._links.ranks, {"op": "status"})
        states = {rank: reply["state"] for rank, reply in replies.items()}
        self._note_devices(states)
        gone = {rank: f"gone ({why})" for rank, why in self._links.gone().items()}
        for rank in self._links.ranks:
            if rank not in states and rank not in gone:
                gone[rank] = "no answer"
        return JobStatus(
            self.job,
            states,
            gone,
            hang_lines(list(states.values()), threshold),
            self._paused_step,
        )

    def _note_devices(self, states: Mapping[int, RankState]) -> None:
        """The topology's device and backend as the ranks last said (a rank attached
        before its group formed says ``-``)."""
        self._records = [
            dataclasses.replace(r, device=states[r.rank].device, backend=states[r.rank].backend)
            if r.rank in states
            else r
            for r in self._records
        ]

    def check(self) -> JobStatus:
        """The status (as ``Pool.check()`` is for a pool: what ``%fsdp status`` shows)."""
        return self.status()

    def stacks(
        self, code: str | None = None, *, native: bool = False
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Every rank's training-thread stack with source lines, and a one-line summary,
        as ``Pool.stacks`` returns them; without pausing."""
        self._live()
        report = self._diagnosis.stacks(code=code, native=native)
        stacks = dict(report.stacks)
        for rank, text in report.native.items():
            stacks[rank] += f"\n--- native stack (py-spy) ---\n{text}"
        return stacks, report.where

    def trace(
        self, last: int = 20, targets: Targets = None, *, issued_at: bool = False
    ) -> CollectiveTrace:
        """Every rank's recent collectives and which rank is behind, as ``Pool.trace``."""
        self._live()
        if isinstance(last, bool) or not isinstance(last, int) or last < 1:
            raise ValueError(f"last must be a number of collectives >= 1, got {last!r}")
        ranks = resolve_targets(targets, len(self._records))
        dumps = self._diagnosis.trace(ranks, issued_at=issued_at)
        where = {r: s.where for r, s in self.status().states.items()}
        findings = diagnose(dumps, finished=[], where=where)
        silent = [rank for rank in ranks if rank not in dumps]
        if silent:
            findings.append(f"no answer from ranks {silent}")
        return CollectiveTrace(dumps, findings, last)

    def hang_report(self, after: float | None = None) -> HangReport | None:
        """``None`` unless ranks have waited in a collective for ``after`` seconds (default
        ``hang_after``) or more; then who waits where, which rank is behind (the flight
        recorder's diagnosis) and every rank's stack."""
        threshold = self.hang_after if after is None else float(after)
        status = self.status(threshold)
        if not waiting_ranks(list(status.states.values()), threshold):
            return None
        trace = self.trace()
        stacks, _ = self.stacks()
        return HangReport(status.hang, trace.findings, stacks)

    # ------------------------------------------------------------------ pausing

    def _ask(
        self,
        request: dict[str, Any],
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> dict[int, Any]:
        """Every rank's answer to a request of this session; :class:`JobError` naming the
        ranks that refused or did not answer (:class:`JobRanksGone` when ranks are gone)."""
        self._live()
        ranks = self._links.ranks if ranks is None else list(ranks)
        replies, failures = self._links.ask(ranks, {**request, "session": self._session}, timeout)
        if failures:
            self._live()
            text = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            raise JobError(f"job {self.job}: {request['op']} failed on {text}")
        return replies

    def pause(
        self, at_step: int | None = None, timeout: float | None = None, *, wait: bool = True
    ) -> int:
        """Pause every rank after the same optimizer step: ``at_step``, else the next one
        no rank has passed; returns the step. Waits up to ``timeout`` seconds (``None``:
        until it happens); if it does not happen in time, or the wait is interrupted, the
        pause is withdrawn (no rank stays paused) and ``TimeoutError`` or
        ``KeyboardInterrupt`` is raised. ``wait=False`` arms the pause and returns at once:
        the ranks pause when they get there (``status()`` shows each rank's
        ``pause_target``), and the next call that needs the pause (or ``pause()`` again)
        waits for it."""
        if at_step is not None and (
            isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 1
        ):
            raise ValueError(f"at_step must be an optimizer step number >= 1, got {at_step!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be seconds > 0 or None, got {timeout!r}")
        if self._paused_step is not None and at_step in (None, self._paused_step):
            return self._paused_step
        began = time.monotonic()
        if self._pending_step is not None and at_step in (None, self._pending_step):
            target = self._pending_step
        else:
            target = self._arm(at_step)
        if not wait:
            self._pending_step = target
            return target
        try:
            self._wait_paused(target, began, timeout)
        except BaseException:
            self._withdraw()
            raise
        self._paused_step, self._pending_step = target, None
        log.info(
            "job %s paused after step %d in %.2f s", self.job, target, time.monotonic() - began
        )
        return target

    def _arm(self, at_step: int | None) -> int:
        """Ask every rank to pause after ``at_step``, else after the step after the
        furthest rank's (each rank first arms its own next step and says how far it is;
        the ranks short of the furthest are then asked again), one further while a rank
        passed it meanwhile; the step."""
        try:
            replies = self._ask({"op": "pause", "step": at_step})
            counts = {r: a["count"] for r, a in replies.items()}
            if at_step is not None:
                passed = [
                    r
                    for r, a in replies.items()
                    if a["count"] >= at_step and a["paused"] != at_step
                ]
                if passed:
                    raise JobError(
                        f"job {self.job} is past step {at_step} (ranks at steps "
                        f"{sorted(set(counts.values()))}); pause at a later step, or at the "
                        "next one"
                    )
                return at_step
            target = max(counts.values()) + 1
            asked = {r: a["target"] for r, a in replies.items()}  # each armed its next step
            while True:
                again = [r for r, step in asked.items() if step != target]
                if not again:
                    return target
                replies = self._ask({"op": "pause", "step": target}, again)
                asked.update(dict.fromkeys(again, target))
                passed = [
                    r for r, a in replies.items() if a["count"] >= target and a["paused"] != target
                ]
                if passed:  # went past it meanwhile: every rank one step further
                    target = max(a["count"] for a in replies.values()) + 1
        except BaseException:
            self._withdraw()
            raise

    def _wait_paused(self, target: int, began: float, timeout: float | None) -> None:
        waiting = set(self._links.ranks)
        while waiting:
            slice_s = 1.0
            if timeout is not None:
                left = timeout - (time.monotonic() - began)
                if left <= 0:
                    status = self.status()
                    where = "; ".join(
                        f"rank {r}: step {status.states[r].step}, {status.states[r].where}"
                        for r in sorted(waiting)
                        if r in status.states
                    )
                    raise TimeoutError(
                        f"job {self.job} did not pause after step {target} within {timeout} s "
                        f"(the pause was withdrawn): {where}"
                    )
                slice_s = min(slice_s, left)
            replies = self._ask(
                {"op": "wait_paused", "timeout": slice_s}, sorted(waiting), slice_s + 5
            )
            waiting -= {r for r, a in replies.items() if a["paused"] == target}

    def _withdraw(self) -> None:
        if self._detached:
            return
        self._links.ask(self._links.ranks, {"op": "resume", "session": self._session})
        self._paused_step = self._pending_step = None

    def resume(self) -> None:
        """Let the paused job go on (an armed pause is withdrawn; nothing happens when the
        job runs)."""
        self._ask({"op": "resume"})
        self._paused_step = self._pending_step = None

    # ------------------------------------------------------------------ while paused

    def _paused(self) -> None:
        self._live()
        if self._paused_step is None and self._pending_step is not None:
            self.pause()  # armed earlier: wait until every rank is there
        if self._paused_step is None:
            raise JobNotPaused(self.job)

    def run(
        self,
        code: str,
        targets: Targets = None,
        timeout: float | None = None,
        stream: bool = True,
        *,
        on_output: OutputSink | None = None,
        cell: int | None = None,
        **ignored: Any,
    ) -> RunResult:
        """Run ``code`` on the targeted ranks' training threads (paused); ``Pool.run``'s
        signature (its journal options are accepted and ignored: a job has no journal).
        The output comes when the cell ends (not while it runs); a rank that raised
        raises :class:`RankError`. ``timeout``: ``TimeoutError`` when the ranks take
        longer (the cell goes on running there)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string of Python source, got {type(code).__name__}")
        self._paused()
        ranks = resolve_targets(targets, len(self._records))
        began = time.monotonic()
        limit = _NO_LIMIT_S if timeout is None else float(timeout)
        request = {"op": "run", "code": code, "cell": cell or 0, "timeout": limit}
        outcomes = {r: a for r, a in self._ask(request, ranks, limit + 5).items()}
        result = RunResult(ranks=list(ranks), elapsed=time.monotonic() - began)
        for rank in ranks:
            outcome = outcomes[rank]
            result.stdout[rank], result.stderr[rank] = outcome.stdout, outcome.stderr
            result.results[rank] = outcome.result
            result.result_data[rank] = dict(outcome.data)
            result.displays[rank] = []
            if on_output is not None:
                for stream_name in ("stdout", "stderr"):
                    text = getattr(outcome, stream_name)
                    if text:
                        on_output(rank, stream_name, text)
        if on_output is None and stream:
            result.show()
        failed = {r: o for r, o in outcomes.items() if o.error is not None}
        if failed:
            raise RankError(
                {r: o.traceback or "" for r, o in failed.items()},
                {r: o.error for r, o in failed.items()},
            )
        return result

    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        targets: Targets = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on the targeted paused ranks; results in rank order.
        ``fn`` travels by reference (pickled): a function of an importable module."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._paused()
        ranks = resolve_targets(targets, len(self._records))
        limit = _NO_LIMIT_S if timeout is None else float(timeout)
        request = {"op": "call", "function": fn, "args": args, "kwargs": kwargs, "timeout": limit}
        replies = self._ask(request, ranks, limit + 5)
        return [replies[r]["value"] for r in ranks]

    def push(self, mapping: Mapping[str, Any], targets: Targets = None) -> None:
        """Define each ``name: value`` for the cells of the targeted paused ranks."""
        if not isinstance(mapping, Mapping) or not all(isinstance(k, str) for k in mapping):
            raise TypeError("mapping must be a mapping of variable names (str) to values")
        self._paused()
        self._ask(
            {"op": "push", "values": dict(mapping)},
            resolve_targets(targets, len(self._records)),
            120,
        )

    def pull(self, name: str, targets: Targets = None) -> list[Any]:
        """The value of ``name`` as the cells see it on each targeted paused rank, with
        every tensor on the CPU, in rank order."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be a variable name, got {name!r}")
        self._paused()
        ranks = resolve_targets(targets, len(self._records))
        replies = self._ask({"op": "pull", "name": name, "timeout": 120}, ranks, 125)
        return [replies[r]["value"] for r in ranks]

    # ------------------------------------------------------------------ leaving

    def detach(self) -> None:
        """Resume the job (if paused) and leave it; it runs on as if never attached.
        The snapshots taken while attached are dropped (persist one first to keep it)."""
        if self._detached:
            return
        self._links.ask(self._links.ranks, {"op": "detach", "session": self._session})
        self._links.close()
        self._detached = True
        self._paused_step = self._pending_step = None
        log.info("detached from job %s", self.job)

    stop = detach

    def _not_here(self, what: str) -> JobError:
        return JobError(
            f"job {self.job} was not started by this notebook: it is not {what} from here "
            "(its launcher, torchrun or SLURM, owns its processes)",
            DETACH,
        )

    def restart(self) -> None:
        """Refused: the job's launcher owns its processes (raises :class:`JobError`)."""
        raise self._not_here("restarted")

    def recover(self, *args: Any, **kwargs: Any) -> None:
        """Refused: a job has no journal to replay (raises :class:`JobError`)."""
        raise self._not_here("recovered")

    def interrupt(self, targets: Targets = None) -> None:
        """Refused: a job's signal handlers are its own (raises :class:`JobError`)."""
        raise self._not_here("interrupted")

    def debug(self, rank: int, command: str | None = None) -> None:
        """Refused: the job keeps no failed cell to look at (raises :class:`JobError`)."""
        raise self._not_here("debugged post mortem")

    def run_script(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the job runs its own script (raises :class:`JobError`)."""
        raise self._not_here("given a script to run")

    def continue_script(self, *args: Any, **kwargs: Any) -> None:
        """Refused: no script run of this notebook's is paused on the job (raises
        :class:`JobError`)."""
        raise self._not_here("given a script to run")

    def script_status(self) -> None:
        """``None``: no script run of this notebook's is on the job (see
        :meth:`status`)."""
        return None

    def export(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the job is a script already and has no journal to write one from
        (raises :class:`JobError`)."""
        raise self._not_here("exported")

    def __enter__(self) -> AttachedJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _no_signal(ranks: list[int], sig: int) -> None:
    """An attached job's ranks are not signalled (their signal handlers are the job's)."""


def attach(
    target: str | os.PathLike | None = None,
    *,
    attach_dir: str | os.PathLike | None = None,
    hosts: Sequence[str] | None = None,
    ssh_args: Sequence[str] = (),
    python: str | None = None,
    take_over: bool = False,
    hang_after: float = DEFAULT_HANG_AFTER_S,
    wait: float = 0.0,
) -> AttachedJob:
    """Attach this notebook to a running attachable job; an :class:`AttachedJob`.

    ``target``: a job's folder or attach dir, a SLURM job id, or a job's name (default: the
    only attachable job of this user on this host; see :mod:`._attach_find`). ``hosts``:
    look for the job's records on these hosts (over ssh, ``ssh_args`` added; ``python``:
    the interpreter there, default this one's path). ``take_over``: attach even while
    another notebook is attached (it is detached). ``hang_after``: seconds in one
    collective after which :meth:`AttachedJob.status` reports a hang. ``wait``: seconds
    to wait for the job's ranks to write their records (a job just started).
    """
    if not isinstance(hang_after, (int, float)) or isinstance(hang_after, bool) or hang_after <= 0:
        raise ValueError(f"hang_after must be seconds > 0, got {hang_after!r}")
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        raise ValueError(f"wait must be seconds >= 0, got {wait!r}")
    deadline = time.monotonic() + wait
    while True:
        try:
            found = find_job(
                target, attach_dir=attach_dir, hosts=hosts, ssh_args=ssh_args, python=python
            )
            break
        except AttachError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)  # the job's ranks have not all written their records yet
    links = JobLinks(found, ssh_args=ssh_args)
    session = secrets.token_hex(16)
    client = {"host": socket.gethostname(), "pid": os.getpid(), "user": _user()}
    answers = links.open_sessions(
        {
            "op": "session",
            "session": session,
            "client": client,
            "take_over": bool(take_over),
            "snapshot_key": new_key(),
        }
    )
    states = {rank: answer["state"] for rank, answer in answers.items()}
    job = AttachedJob(links, states, session=session, hang_after=hang_after)
    log.info("attached to job %s (%d ranks)", job.job, len(states))
    return job
