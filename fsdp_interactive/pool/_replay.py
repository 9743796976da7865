"""The replay phase of a recovery (kernel side): the slice's entries run again on the fresh
group, each with the random generators its original started and ended with, parameter
initialization deferred where the snapshot overwrites it.

1. :func:`prepare`: every rank gets, in one call, the generator states its original rank
   reported for each entry to replay (:class:`~._generator_states.GeneratorStates`) and
   which entries may defer initialization (:attr:`~._slice.ReplaySlice.skip_init`);
2. each entry runs as a replay of itself (``Pool.run(..., replayed=entry.id)``): the ranks
   set the generators to the original's start, defer ``torch.nn.init`` where asked, and at
   the end set the generators to the original's end (:mod:`.rank._cell_watch`); its output
   is not shown, one line per entry is;
3. :func:`finish`: every rank initializes what was deferred and is not a parameter or
   buffer of the objects the snapshot restores (:mod:`.rank._init_deferral`).

A failure in any of them is the caller's to handle (the recovery then leaves a fresh group).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.pool._journal import JournalEntry
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


def prepare(pool: Pool, sliced: ReplaySlice) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Give every rank its part of the replay plan (one call, each rank its own states);
    the entries some ranks have no generator states for."""
    entries = sliced.replay
    states = pool.journal.generators
    ranks = range(pool.world_size)
    plans = {}
    for rank in ranks:
        plan = states.for_replay([e.id for e in entries], rank)
        for entry in entries:
            plan.setdefault(entry.id, {})["skip_init"] = entry.id in sliced.skip_init
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
    pool: Pool, entries: Sequence[JournalEntry], say: Callable[[str], None]
) -> dict[int, float]:
    """Run ``entries`` again, in order, as replays; each one's seconds. The first failure
    raises (the entry's label is in :class:`ReplayFailed`)."""
    seconds = {}
    for entry in entries:
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
        say(f"recovery: replayed {entry.label} in {seconds[entry.id]:.2f} s")
    return seconds


class ReplayFailed(Exception):
    """Replaying ``entry`` raised ``error``."""

    def __init__(self, entry: JournalEntry, error: BaseException) -> None:
        super().__init__(f"replaying {entry.label} failed")
        self.entry = entry
        self.error = error


def finish(pool: Pool, restored: Sequence[str]) -> dict[str, int]:
    """Every rank runs the initializations deferred for tensors the objects at ``restored``
    (the snapshot's locations) do not hold; rank 0's counts."""
    code = (
        "from fsdp_interactive.pool.rank._cell_watch import finish_replay as _fsdpi_finish\n"
        f"{_DEFERRED} = _fsdpi_finish(globals(), {list(restored)!r})\n"
        "del _fsdpi_finish\n"
    )
    pool.run(code, stream=False, journal=False)
    try:
        counts = pool.pull(_DEFERRED, targets=[0])[0]
    finally:
        pool.run(f"globals().pop({_DEFERRED!r}, None)", stream=False, journal=False)
    return {str(k): int(v) for k, v in dict(counts).items()}


def replay(
    pool: Pool, sliced: ReplaySlice, restored: Sequence[str], say: Callable[[str], None]
) -> ReplayOutcome:
    """The whole replay phase (see the module's docstring)."""
    lacking = prepare(pool, sliced)
    seconds = run_entries(pool, sliced.replay, say)
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
