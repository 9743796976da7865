"""What a recovery says it did (kernel side): :class:`RecoveryReport`, and who is told
(:class:`RecoveryWatchers`).

Besides the snapshot, the calls replayed and each phase's seconds, the report names three
sets of objects, so that nothing comes back, or stays away, without a word:

* **restored**: the objects the snapshot was loaded into (where each is: ``model``,
  ``trainer.optimizer``), and from which snapshot;
* **rebuilt by the replay**: every other public name the ranks hold after the recovery
  (the pool's own ``torch``, ``dist``, ``rank``, ... left out): what the replayed calls
  defined again;
* **lost**: the names rank 0 held after the last call it reported
  (:attr:`~._journal.Journal.names`) that are not back, each with the journal entry that
  defined it last and how to get it back (:func:`lost_names`): run that cell again, or
  mark it ``%%fsdp --replay`` so that every recovery replays it.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive.pool import _replay
from fsdp_interactive.pool._cell_effects import PREFILLED
from fsdp_interactive.pool._journal import JournalEntry
from fsdp_interactive.pool._slice import ReplaySlice
from fsdp_interactive.pool._snapshots import SnapshotInfo

log = logging.getLogger(__name__)

#: Names listed in one line at most; the rest are counted.
_SHOWN = 24
#: How the snapshot's kinds of object are named.
_KINDS = {"model": "the model", "optimizer": "the optimizer"}


def calls_text(count: int) -> str:
    return f"{count} call" if count == 1 else f"{count} calls"


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


@dataclass(frozen=True)
class LostName:
    """A name the ranks held before the recovery and do not hold after it: ``entry`` is
    the label of the journal entry that defined it last (``None``: none did), ``how`` what
    brings it back."""

    name: str
    entry: str | None
    how: str

    def line(self) -> str:
        return f"{self.name} ({self.how})"


def lost_names(
    before: Iterable[str],
    after: Iterable[str],
    entries: Sequence[JournalEntry],
    sliced: ReplaySlice,
    snapshot_call: int | None = None,
) -> tuple[LostName, ...]:
    """The names in ``before`` and not in ``after``, each with how to get it back, from the
    journal's ``entries`` (oldest first), the replay's ``sliced`` parts (an entry without
    a part came after the snapshot's) and the entry that took the snapshot."""
    parts = {part.entry.id: part for part in sliced.parts}
    replayed = {entry.id for entry in sliced.replay}
    lost = []
    for name in sorted(set(before) - set(after)):
        if name.startswith("_") or name in PREFILLED:
            continue
        entry = next(
            (
                e
                for e in reversed(entries)
                if e.outcome != "running" and (name in e.effects.defines or name in e.rebound)
            ),
            None,
        )
        how = _how(entry, parts, replayed, snapshot_call)
        lost.append(LostName(name, entry.label if entry else None, how))
    return tuple(lost)


def _how(
    entry: JournalEntry | None,
    parts: Mapping[int, Any],
    replayed: set[int],
    snapshot_call: int | None,
) -> str:
    if entry is None:
        return (
            "no journaled call defines it: it was set by Pool.push, %fsdp push or "
            "Pool.call; set it again"
        )
    label = entry.label
    if entry.outcome != "ok":
        return f"{label} defines it and ended with {entry.outcome}: run {label} again"
    if entry.replay is False:
        return f"{label} defines it and is marked --no-replay: run {label} again"
    if entry.id in replayed:
        return f"{label} was replayed but did not define it again: run {label} again"
    part = parts.get(entry.id)
    if entry.id == snapshot_call:
        return f"{label} defines it and took the snapshot, so it is not replayed: run {label} again"
    if part is None:
        return f"{label} defines it, after the snapshot: run {label} again"
    return (
        f"{label} defines it, and the replay skipped it ({part.why}): run {label} again, "
        "or mark it %%fsdp --replay (Pool.run(..., replay=True)) so that every recovery "
        "replays it"
    )


def rebuilt_names(after: Iterable[str], restored: Mapping[str, str]) -> tuple[str, ...]:
    """The public names after a recovery that the snapshot did not restore into and the
    pool does not set itself: what the replay defined again."""
    roots = {str(where).split(".", 1)[0] for where in restored.values()}
    return tuple(sorted(n for n in after if not n.startswith("_") and n not in PREFILLED | roots))


@dataclass(frozen=True)
class RecoveryReport:
    """What a recovery did: the ``plan``, the snapshot it went back to (``snapshot``; may
    differ from the plan's when a newer one was found or the planned one was refused),
    the calls it ``replayed``, the new ``world_size``, the seconds of each phase and the
    ranks' own restore report (``restored``: rank 0's); ``rebuilt`` and ``lost``: the
    names the replay defined again and those that are not back (module docstring)."""

    plan: Any  # the RecoveryPlan
    snapshot: SnapshotInfo | None
    replayed: tuple[JournalEntry, ...]
    world_size: int
    phases: Mapping[str, float] = field(default_factory=dict)
    restored: Any = None
    refused: tuple[str, ...] = ()
    #: What the replay did beyond running the entries (:class:`~._replay.ReplayOutcome`).
    replay_outcome: _replay.ReplayOutcome | None = None
    rebuilt: tuple[str, ...] = ()
    lost: tuple[LostName, ...] = ()
    #: Why the replay ran every initialization after all (``""``: it did not have to).
    replayed_again: str = ""

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def step(self) -> int | None:
        """The training step the snapshot was taken at (``None``: not given, or a folder)."""
        return None if self.snapshot is None else self.snapshot.step

    def summary(self) -> str:
        """``recovered to the snapshot s000004 of step 40 (taken 12 s ago) in 4.1 s``."""
        target = self.plan.target if self.snapshot is None else self.snapshot.describe()
        return f"recovered to the {target} in {self.seconds:.1f} s"

    def restored_line(self) -> str:
        """``restored from s000004: model (the model), optim (the optimizer)``."""
        names = dict((self.restored or {}).get("names") or {})
        if not names:
            return ""
        source = self.snapshot.id if self.snapshot is not None else self.plan.target
        shown = ", ".join(f"{where} ({_KINDS.get(k, repr(k))})" for k, where in names.items())
        return f"restored from {source}: {shown}"

    def names_lines(self) -> list[str]:
        """The restored, rebuilt and lost lines (those that have names)."""
        lines = [self.restored_line()] if self.restored_line() else []
        if self.rebuilt:
            lines.append(f"rebuilt by the replay: {_listed(self.rebuilt)}")
        if self.lost:
            lines.append(f"lost ({len(self.lost)}): " + "; ".join(n.line() for n in self.lost))
        return lines

    def lines(self) -> list[str]:
        cells = ", ".join(e.label for e in self.replayed) or "none"
        phases = ", ".join(f"{name} {secs:.2f} s" for name, secs in self.phases.items())
        lines = [
            self.summary(),
            f"{self.world_size} ranks; replayed {calls_text(len(self.replayed))}: {cells}",
            *self.names_lines(),
            f"phases: {phases}",
        ]
        outcome = self.replay_outcome
        if self.replayed_again:
            lines.append(f"replay: ran again with every initialization: {self.replayed_again}")
        if outcome is not None and (outcome.skipped_inits or outcome.run_inits):
            lines.append(
                f"replay: {outcome.skipped_inits} parameter initializations skipped (the "
                f"snapshot writes them), {outcome.run_inits} run as the original did"
            )
        if outcome is not None:
            lines += [
                f"replay: {label} ran without rank(s) {', '.join(map(str, ranks))}'s original "
                "random generators (their report was lost with the rank)"
                for label, ranks in outcome.without_generators
            ]
        lines += [f"refused: {reason}" for reason in self.refused]
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


class RecoveryWatchers:
    """The callbacks told of every recovery that succeeds (``Pool.when_recovered``), by
    ``recover()`` or by itself (``recover="auto"``): what a view of the ranks refreshes on.
    A bound method is held weakly (a view that is gone is not called); a callback that
    raises is logged and does not fail the recovery."""

    def __init__(self) -> None:
        self._held: list[Callable[[], Callable[[RecoveryReport], None] | None]] = []

    def add(self, callback: Callable[[RecoveryReport], None]) -> None:
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        held = weakref.WeakMethod(callback) if inspect.ismethod(callback) else (lambda: callback)
        self._held.append(held)

    def tell(self, report: RecoveryReport) -> None:
        """Call every callback still alive with ``report``."""
        self._held[:] = [held for held in self._held if held() is not None]
        for held in list(self._held):
            callback = held()
            if callback is None:
                continue
            try:
                callback(report)
            except Exception as error:
                log.warning("a callback after the recovery failed: %s", error)
