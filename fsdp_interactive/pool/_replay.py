"""The replay phase of a recovery (kernel side): the slice's entries run again on the fresh
group, each with the random generators its original started and ended with, parameter
initialization skipped exactly for the tensors the snapshot writes.

1. :func:`prepare`: every rank gets, in one call, the generator states its original rank
   reported for each entry to replay (:class:`~._generator_states.GeneratorStates`) and,
   per entry, the initialization calls it may skip: the entry's *restored suffix*
   (:func:`restored_suffix`), from the calls its original rank made and where each tensor
   ended (:attr:`~._journal.JournalEntry.inits`);
2. each entry runs as a replay of itself (``Pool.run(..., replayed=entry.id)``): the ranks
   set the generators to the original's start, skip the initialization calls of the
   suffix, and at the end set the generators to the original's end
   (:mod:`.rank._cell_watch`, :mod:`.rank._init_deferral`); its output is not shown, one
   line per entry is;
3. :func:`finish`: every rank counts the calls skipped and run, and names each skipped
   tensor that no object the snapshot restores holds: :class:`InitsLeftUnset` (the
   recovery then replays again with every initialization run).

A failure in any of them is the caller's to handle (the recovery then leaves a fresh group).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.pool._journal import JournalEntry
from fsdp_interactive.pool._recovery_progress import RecoveryProgress
from fsdp_interactive.pool._slice import ReplaySlice
from fsdp_interactive.pool.rank import _cell_watch, _results

#: A :class:`~._pool.Pool` (not imported: the pool imports the recovery).
Pool = Any

_DEFERRED = "_fsdp_interactive_deferred"


@dataclass(frozen=True)
class ReplayOutcome:
    """What a replay did: the entries it ran (``replayed``), each one's seconds,
    ``skipped_inits`` / ``run_inits``: parameter initializations dropped because the
    snapshot overwrites them / run after the replay (rank 0's counts), and
    ``without_generators``: ``(entry label, ranks)`` replayed without the original's
    generator states (their report never reached the kernel)."""

    replayed: tuple[JournalEntry, ...]
    seconds: Mapping[int, float]
    skipped_inits: int = 0
    run_inits: int = 0
    without_generators: tuple[tuple[str, tuple[int, ...]], ...] = ()


def restored_suffix(
    calls: Sequence[tuple[str, Sequence[int], Sequence[str]]], restored: Iterable[str]
) -> int:
    """The first of ``calls`` (an entry's initialization calls, ``(function, shape,
    locations)``) from which every call's tensor is held by an object at one of the
    locations ``restored``: the snapshot writes them. ``len(calls)`` when the last call's
    tensor is not held. Skipping only a suffix keeps every call before it on the
    generators the original had."""
    held = set(restored)
    first = len(calls)
    for index in range(len(calls) - 1, -1, -1):
        if not held.intersection(calls[index][2]):
            break
        first = index
    return first


def _skip_plan(entry: JournalEntry, rank: int, restored: Sequence[str]) -> dict[str, Any] | None:
    calls = entry.inits.get(rank)
    # A script run trains on its parameters before it pauses: it draws them all.
    if not calls or not restored or entry.script is not None:
        return None
    return {"from": restored_suffix(calls, restored), "calls": [(f, s) for f, s, _ in calls]}


def prepare(
    pool: Pool, sliced: ReplaySlice, written: Sequence[str], *, skip_inits: bool = True
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Give every rank its part of the replay plan (one call, each rank its own states and
    the initialization calls it may skip: those whose tensors ended at one of the
    locations the snapshot ``written``, none without ``skip_inits``); the entries some
    ranks have no generator states for."""
    entries = sliced.replay
    states = pool.journal.generators
    ranks = range(pool.world_size)
    plans = {}
    for rank in ranks:
        plan = states.for_replay([e.id for e in entries], rank)
        for entry in entries:
            skip = _skip_plan(entry, rank, written) if skip_inits else None
            plan.setdefault(entry.id, {})["skip_init"] = skip
        plans[rank] = plan
    views = pool._begin(None, None)
    handles = {
        rank: view.apply_async(_results.call, _cell_watch.prepare_replay, plans[rank])
        for rank, view in views.items()
    }
    with pool._faults.outcome(None):
        pool._pending(handles, stream=True).wait(None)
    lacking = []
    for entry in entries:
        known = states.ranks_of(entry.id)
        absent = tuple(r for r in ranks if r not in known)
        if absent:
            lacking.append((entry.label, absent))
    return tuple(lacking)


def run_entries(
    pool: Pool, entries: Sequence[JournalEntry], progress: RecoveryProgress
) -> dict[int, float]:
    """Run ``entries`` again, in order, as replays, each shown on ``progress`` as it starts
    and ends; each one's seconds. The first failure raises (the entry's label is in
    :class:`ReplayFailed`)."""
    seconds = {}
    for number, entry in enumerate(entries, 1):
        progress.phase(f"replaying {entry.label} ({number} of {len(entries)})")
        began = time.monotonic()
        targets = entry.targets
        if targets is not None:
            targets = [rank for rank in targets if rank < pool.world_size] or None
        try:
            pool.run(
                entry.source,
                targets=targets,
                cell=entry.cell,
                stream=False,
                journal=False,
                replaying=True,
                replayed=entry.id,
            )
        except Exception as error:
            raise ReplayFailed(entry, error) from error
        seconds[entry.id] = time.monotonic() - began
        progress.done(f"replayed {entry.label} in {seconds[entry.id]:.2f} s")
    return seconds


class ReplayFailed(Exception):
    """Replaying ``entry`` raised ``error``."""

    def __init__(self, entry: JournalEntry, error: BaseException) -> None:
        super().__init__(f"replaying {entry.label} failed")
        self.entry = entry
        self.error = error


class InitsLeftUnset(Exception):
    """Tensors whose initialization the replay skipped and that no object the snapshot
    restores holds (``unset``: where each is, by rank)."""

    def __init__(self, unset: Mapping[int, Sequence[str]]) -> None:
        first = next(iter(unset.values()))
        more = f" and {len(first) - 3} more" if len(first) > 3 else ""
        super().__init__(
            f"the replay skipped the initialization of {', '.join(first[:3])}{more}, which "
            "the snapshot does not write"
        )
        self.unset = dict(unset)


def finish(pool: Pool, restored: Sequence[str]) -> dict[str, Any]:
    """Every rank counts the initialization calls it skipped and ran, and names the
    skipped ones no object at ``restored`` (the snapshot's locations) holds; rank 0's
    counts. :class:`InitsLeftUnset` when any rank names one."""
    code = (
        "from fsdp_interactive.pool.rank._cell_watch import finish_replay as _fsdpi_finish\n"
        f"{_DEFERRED} = _fsdpi_finish(globals(), {list(restored)!r})\n"
        "del _fsdpi_finish\n"
    )
    pool.run(code, stream=False, journal=False)
    try:
        counts = pool.pull(_DEFERRED)
    finally:
        pool.run(f"globals().pop({_DEFERRED!r}, None)", stream=False, journal=False)
    unset = {rank: list(c["unset"]) for rank, c in enumerate(counts) if c.get("unset")}
    if unset:
        raise InitsLeftUnset(unset)
    return dict(counts[0])


def replay(
    pool: Pool,
    sliced: ReplaySlice,
    restored: Sequence[str],
    progress: RecoveryProgress,
    *,
    skip_inits: bool = True,
    held_at: Sequence[str] = (),
) -> ReplayOutcome:
    """The whole replay phase (see the module's docstring), shown on ``progress``:
    ``restored`` are the snapshot's locations, ``held_at`` every location its modules had
    when it was taken (a tensor that ended at either is written by the restore);
    ``skip_inits=False`` runs every initialization."""
    progress.phase("preparing the replay")
    written = [*restored, *(w for w in held_at if w not in restored)]
    lacking = prepare(pool, sliced, written, skip_inits=skip_inits)
    seconds = run_entries(pool, sliced.replay, progress)
    progress.phase("checking what the replay initialized")
    counts = finish(pool, restored)
    return ReplayOutcome(
        sliced.replay,
        seconds,
        counts.get("skipped", 0),
        counts.get("initialized", 0),
        lacking,
    )


def restored_locations(names: Mapping[str, Any] | None) -> list[str]:
    """The locations of a snapshot's objects (its record's ``names``)."""
    if not names:
        return []
    found = [names.get("model"), names.get("optimizer")]
    found += list((names.get("stateful") or {}).values())
    return [str(path) for path in found if isinstance(path, str)]
