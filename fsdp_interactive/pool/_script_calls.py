"""``Pool.run_script``, ``Pool.continue_script`` and ``Pool.script_status`` (kernel side).

A script run is one notebook call on the targeted ranks, journaled like a cell: every rank
runs the rank-side runner (:mod:`.rank._script_run`) with the script's source, read here
(so every rank runs the same text, also on hosts that do not share the file), its
arguments, working directory and where each rank stands as torchrun would say it (its
host's index, the number of hosts). Its output streams as a cell's does; when it returns,
every rank has paused after the same optimizer step, or the script has ended, and the
names it built are bound on the ranks. The kernel then asks the ranks for their
:class:`ScriptStatus` (rank order; the first target's view is shown).

While the script runs, the first Ctrl-C asks the ranks to pause after their next
optimizer step (the call goes on until they do); the second interrupts them as any call.

The script's source and its place are sent to the ranks ahead of the journaled call (one
round trip, not journaled), so that the call itself is one short line in tracebacks and
stacks. Each call's journal entry gets a :class:`~._script_record.ScriptRecord`, and its
source is rewritten to the call that reproduces what happened, with everything in it (a
recovery replays it on fresh ranks).

Faults: a rank that dies during a run fails the call with ``RankDied`` as a cell's would
(the entry is never replayed); one that dies while the script is paused is found by the
next call, and ``recover()`` replays the run to its last pause before the snapshot.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive.pool._dispatch import Targets, resolve_targets
from fsdp_interactive.pool._output import OutputSink
from fsdp_interactive.pool._script_record import (
    ScriptRecord,
    call_code,
    received_call,
    replay_code,
)
from fsdp_interactive.pool.errors import Advised, PoolError, Step
from fsdp_interactive.pool.rank import _script_run

#: A :class:`~._pool.Pool` (not imported: the pool imports this module).
Pool = Any

CONTINUE = Step("resume it with {}", "pool.continue_script()", "%fsdp continue")
STOP_RUN = Step("end it with {}", "pool.continue_script(stop=True)", "%fsdp continue --stop")
RUN = Step("start one with {}", "pool.run_script(path, stop_at=N)", "%fsdp run SCRIPT --stop-at N")
_run_ids = itertools.count(1)


class ScriptRunError(Advised, PoolError):
    """A script call that cannot be made now (another run is paused, none is); the
    message says what to type instead."""

    def __init__(self, message: str, *steps: Step):
        self._head = message
        self.advice = steps
        super().__init__(self._compose(False))


@dataclass(frozen=True)
class ScriptStatus:
    """Where a script run stands, as the ranks tell it.

    ``script``: its path; ``state``: ``"paused"``, ``"ended"``, ``"stopped"``, ``"failed"``,
    ``"interrupted"`` or ``"running"``; ``steps``: optimizer steps taken; ``paused_by``:
    ``"stop-at"`` or ``"interrupt"``; ``kept``: ``(name, summary)`` of each name it left
    on the ranks (the first target's values), ``definitions``: how many more names hold
    modules, functions and classes; ``replaced``: names whose earlier value (a cell's) it
    replaced; ``error``: what it raised; ``ranks``: the ranks it runs on; ``steps_by_rank``:
    each rank's count (they agree unless the run targets part of the ranks).
    """

    script: str
    state: str
    steps: int
    stop_at: int | None = None
    paused_by: str | None = None
    kept: tuple[tuple[str, str], ...] = ()
    definitions: int = 0
    replaced: tuple[str, ...] = ()
    error: str | None = None
    ranks: tuple[int, ...] = ()
    steps_by_rank: Mapping[int, int] = field(default_factory=dict)

    @property
    def paused(self) -> bool:
        return self.state == "paused"

    @property
    def name(self) -> str:
        return os.path.basename(self.script)

    def lines(self, notebook: bool = False) -> list[str]:
        """What a user reads after the call: where the run stands and what to type next,
        what it kept, what it replaced."""
        go_on = "%fsdp continue" if notebook else "pool.continue_script()"
        stop = "%fsdp continue --stop" if notebook else "pool.continue_script(stop=True)"
        steps = f"{self.steps} optimizer step{'s' if self.steps != 1 else ''}"
        if self.paused:
            why = " (interrupt)" if self.paused_by == "interrupt" else ""
            head = (
                f"{self.name} paused after {steps}{why}; type {go_on} [--stop-at N] to go on"
                if notebook
                else f"{self.name} paused after {steps}{why}; {go_on} goes on (stop_at=N "
                "pauses again)"
            )
            head += f", {stop} to end it"
        elif self.state == "ended":
            head = f"{self.name} ended after {steps}"
        elif self.state == "stopped":
            head = f"{self.name} stopped at its pause after {steps}"
        else:
            head = f"{self.name} {self.state} after {steps}" + (
                f": {self.error}" if self.error else ""
            )
        lines = [head]
        if len(set(self.steps_by_rank.values())) > 1:
            counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(self.steps_by_rank.items()))
            lines.append(f"the ranks took different numbers of steps ({counts})")
        if self.kept or self.definitions:
            shown = ", ".join(f"{name} ({what})" for name, what in self.kept)
            more = (
                f"{' and ' if shown else ''}{self.definitions} module, function and class names"
                if self.definitions
                else ""
            )
            lines.append(f"kept on the ranks: {shown}{more}")
        if self.replaced:
            lines.append(
                "replaced the earlier values of: "
                + ", ".join(self.replaced)
                + " (an earlier cell's or run's)"
            )
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


def run_script(
    pool: Pool,
    path: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    targets: Targets = None,
    stop_at: int | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    stream: bool = True,
    on_output: OutputSink | None = None,
    cell: int | None = None,
    shown: str | None = None,
) -> ScriptStatus:
    """``Pool.run_script`` (see the pool's method). ``shown``: the journal's text for the
    call (the magic line)."""
    script = _script_path(path)
    arguments = _arguments(args)
    stop_at = _script_run.checked_stop_at(stop_at)
    folder = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
    if not os.path.isdir(folder):
        raise ValueError(f"cwd must be an existing folder, got {os.fspath(cwd or '')!r}")
    paused = _paused_status(pool)
    if paused is not None:
        raise ScriptRunError(
            f"{paused.name} is paused after {paused.steps} steps; only one script runs at a time",
            CONTINUE,
            STOP_RUN,
        )
    with open(script, encoding="utf-8") as file:
        source = file.read()
    ranks = resolve_targets(targets, pool.world_size)
    spec = {
        "path": script,
        "source": source,
        "args": list(arguments),
        "cwd": folder,
        "stop_at": stop_at,
        "agree": len(ranks) == pool.world_size,
        "place": _place(pool),
    }
    record = ScriptRecord(
        kind="run",
        run=0,
        path=script,
        args=tuple(arguments),
        cwd=folder,
        digest=hashlib.sha256(source.encode()).hexdigest(),
        world_size=pool.world_size,
        spec=spec,
    )
    key = spec["place"]["run_id"]
    pool._call(_script_run.receive, (key, spec), {}, targets=targets, stream=False)
    code = received_call(key)
    text = shown or f"pool.run_script({script!r}, {list(arguments)!r}, stop_at={stop_at!r})"
    return _journaled_call(pool, code, record, targets, timeout, stream, on_output, cell, text)


def continue_script(
    pool: Pool,
    stop_at: int | None = None,
    *,
    stop: bool = False,
    timeout: float | None = None,
    stream: bool = True,
    on_output: OutputSink | None = None,
    cell: int | None = None,
    shown: str | None = None,
) -> ScriptStatus:
    """``Pool.continue_script`` (see the pool's method)."""
    stop_at = _script_run.checked_stop_at(stop_at)
    if not isinstance(stop, bool):
        raise TypeError(f"stop must be True or False, got {stop!r}")
    if stop and stop_at is not None:
        raise ValueError("give either stop=True or stop_at, not both")
    statuses = _statuses(pool, None)
    paused = [rank for rank, status in statuses.items() if status and status["state"] == "paused"]
    if not paused:
        raise ScriptRunError("no script run is paused", RUN)
    first = statuses[paused[0]]
    if stop_at is not None and stop_at <= first["steps"]:
        raise ValueError(
            f"stop_at={stop_at}: {os.path.basename(first['script'])} has already taken "
            f"{first['steps']} steps; give a later step"
        )
    run_entry = _run_entry(pool, first["script"])
    base = run_entry.script if run_entry is not None else None
    record = ScriptRecord(
        kind="continue",
        run=run_entry.id if run_entry is not None else 0,
        path=first["script"],
        args=base.args if base is not None else (),
        cwd=base.cwd if base is not None else "",
        digest=base.digest if base is not None else "",
        world_size=pool.world_size,
        spec={"stop_at": stop_at, "stop": stop},
    )
    code = call_code("resume", record.spec)
    verb = "stop=True" if stop else f"stop_at={stop_at!r}"
    text = shown or f"pool.continue_script({verb})"
    targets = paused if len(paused) < pool.world_size else None
    return _journaled_call(pool, code, record, targets, timeout, stream, on_output, cell, text)


def script_status(pool: Pool) -> ScriptStatus | None:
    """The current (or last) script run's status on the ranks; ``None``: none ran."""
    statuses = _statuses(pool, None)
    return _combined(statuses) if any(statuses.values()) else None


# ---------------------------------------------------------------------------- the call


def _journaled_call(
    pool: Pool,
    code: str,
    record: ScriptRecord,
    targets: Targets,
    timeout: float | None,
    stream: bool,
    on_output: OutputSink | None,
    cell: int | None,
    shown: str,
) -> ScriptStatus:
    """Run ``code`` as a journaled call whose entry keeps ``record``; its status."""
    ranks = resolve_targets(targets, pool.world_size)

    def pause_on_interrupt(pending: list[int]) -> None:
        print(
            "interrupt: the script pauses after its next optimizer step on every rank; "
            "interrupt again to stop it",
            file=sys.stderr,
            flush=True,
        )
        if pool._live is not None:
            pool._live.signal(pending, signal.SIGINT)

    failure: BaseException | None = None
    try:
        pool.run(
            code,
            targets=targets,
            timeout=timeout,
            stream=stream,
            on_output=on_output,
            cell=cell,
            journal_text=shown,
            on_interrupt=pause_on_interrupt,
        )
    except BaseException as error:
        failure = error
    entry = next((e for e in reversed(pool.journal.entries) if e.source is code), None)
    status = None
    if pool.running and not pool.busy_ranks():
        try:
            status = _combined(_statuses(pool, ranks))
        except Exception:  # the ranks' state is what the failure says
            status = None
    if entry is not None:
        if record.kind == "run":
            record.run = entry.id
        entry.script = record
        if status is not None:
            record.state, record.steps = status.state, status.steps
            entry.source = replay_code(record)
    if failure is not None:
        if status is not None:
            failure.script_status = status  # type: ignore[attr-defined]
        raise failure
    assert status is not None, "the ranks did not report the script's status"
    return status


def _statuses(pool: Pool, ranks: Sequence[int] | None) -> dict[int, dict[str, Any] | None]:
    chosen = list(ranks) if ranks is not None else list(range(pool.world_size))
    answers = pool._call(_script_run.status, (), {}, targets=chosen, stream=False)
    return dict(zip(chosen, answers, strict=True))


def _combined(statuses: Mapping[int, dict[str, Any] | None]) -> ScriptStatus:
    known = {rank: status for rank, status in statuses.items() if status}
    first = known[min(known)]
    return ScriptStatus(
        script=str(first["script"]),
        state=str(first["state"]),
        steps=int(first["steps"]),
        stop_at=first.get("stop_at"),
        paused_by=first.get("paused_by"),
        kept=tuple((str(n), str(s)) for n, s in first.get("kept") or ()),
        definitions=int(first.get("definitions") or 0),
        replaced=tuple(first.get("replaced") or ()),
        error=first.get("error"),
        ranks=tuple(sorted(known)),
        steps_by_rank={rank: int(status["steps"]) for rank, status in known.items()},
    )


def _paused_status(pool: Pool) -> ScriptStatus | None:
    status = script_status(pool) if pool.running else None
    return status if status is not None and status.paused else None


def _run_entry(pool: Pool, path: str) -> Any:
    """The journal entry of the newest run of ``path`` (the run a continue belongs to)."""
    for entry in reversed(pool.journal.entries):
        record = getattr(entry, "script", None)
        if isinstance(record, ScriptRecord) and record.kind == "run" and record.path == path:
            return entry
    return None


def _place(pool: Pool) -> dict[str, Any]:
    """What every rank needs to say where it stands as torchrun would."""
    hosts: dict[str, int] = {}
    group_ranks = {}
    for record in pool.topology:
        group_ranks[str(record.rank)] = hosts.setdefault(record.host, len(hosts))
    return {
        "group_ranks": group_ranks,
        "group_world_size": max(1, len(hosts)),
        "run_id": f"fsdp-interactive-{os.getpid()}-{next(_run_ids)}",
    }


# ---------------------------------------------------------------------------- input checks


def _script_path(path: Any) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be the path of a Python script, got {type(path).__name__}")
    script = os.path.abspath(os.fspath(path))
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no script at {os.fspath(path)!r} (looked at {script})")
    return script


def _arguments(args: Any) -> list[str]:
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a list of strings (the script's command line), got {args!r}")
    bad = [a for a in args if not isinstance(a, str)]
    if bad:
        raise TypeError(f"args must be strings, got {bad[0]!r} ({type(bad[0]).__name__})")
    return list(args)
