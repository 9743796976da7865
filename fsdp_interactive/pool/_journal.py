"""The pool's journal: every notebook call that built the ranks' state, so that a recovery
can build it again.

Each ``Pool.run`` (and so each ``%%fsdp`` cell) is one :class:`JournalEntry`: its code,
cell number, targets, outcome, duration, whether it may be replayed (``%%fsdp
--no-replay`` says never, ``%%fsdp --replay`` always, by default the recovery's slice
decides, :mod:`._slice`), the snapshots taken while it ran, and what the ranks saw it do
(names it rebound or reshaped where its code does not say so, the random generators at its
start and end: :meth:`Journal.note_cell`, from the notice each rank sends after the cell,
:mod:`.rank._cell_watch`). Calls the package makes for itself (probes, panels) are not
entries.

Entries belong to an *epoch*: the life of one process group. ``restart()`` starts an
epoch with nothing behind it (an empty group); a recovery to snapshot ``S`` starts an
epoch whose *base* is the entries it replayed for ``S``: the state it starts from is what
those entries built plus ``S``. :meth:`Journal.replay_for` is then, for a snapshot taken
during entry ``E``: the base of ``E``'s epoch, followed by that epoch's entries before
``E`` that succeeded and may be replayed.

Faults: the journal lives in the kernel, so a dead rank, a wedged collective or a lost
host leaves it whole; an entry whose call was cut short by one records that outcome
(``died``, ``timeout``, ``interrupted``) and is never replayed. ``stop()`` keeps it
(``Pool.journal`` stays readable); a new ``start()`` of a stopped pool begins an empty
epoch, like ``restart()``.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive._text import text_table
from fsdp_interactive.pool._cell_effects import CellEffects, effects_of
from fsdp_interactive.pool._generator_states import GeneratorStates
from fsdp_interactive.pool._script_record import ScriptRecord
from fsdp_interactive.pool.errors import RankDied

#: Outcomes of an entry; only ``ok`` entries are replayed.
OUTCOMES = ("running", "ok", "error", "timeout", "interrupted", "died")


def outcome_of(error: BaseException) -> str:
    """The outcome of a call that raised ``error``."""
    if isinstance(error, RankDied):
        return "died"
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return "error"


@dataclass
class JournalEntry:
    """One notebook call on the ranks.

    ``id``: increasing over the pool's life; ``epoch``: the group it ran on; ``cell``: the
    notebook's execution count (``None`` for a ``Pool.run`` without one); ``targets``:
    ``None`` for every rank; ``started``: wall-clock time; ``seconds``: how long it ran
    (``None`` while running); ``replay``: ``None`` when the recovery's slice decides whether
    to replay it, ``True`` always (``%%fsdp --replay``), ``False`` never (``--no-replay``);
    ``snapshots``: ids of the snapshots taken while it ran (read after the call ends, so in
    its own row at once); ``rebound`` and ``reshaped``: names whose object the ranks saw it
    replace or reshape (hooks, submodules, ``requires_grad``) beyond what its code shows.
    """

    id: int
    epoch: int
    source: str
    cell: int | None = None
    targets: list[int] | None = None
    started: float = field(default_factory=time.time)
    seconds: float | None = None
    outcome: str = "running"
    replay: bool | None = None
    snapshots: list[str] = field(default_factory=list)
    rebound: set[str] = field(default_factory=set)
    reshaped: dict[str, str] = field(default_factory=dict)
    #: What the journal shows for the call instead of ``source`` (the magic line that
    #: generated the code), ``None``: its source.
    shown: str | None = None
    #: A script run or its continuation (``Pool.run_script``): what ran and where it
    #: paused (:class:`~._script_record.ScriptRecord`); ``None`` for other calls.
    script: ScriptRecord | None = None
    #: What the notebook said of the call beyond its code (:meth:`Journal.mark`):
    #: ``"local"`` (``%%fsdp --local``: it also ran in the kernel), ``"train"``
    #: (``%%fsdp --export train``: an export's training cell).
    marks: set[str] = field(default_factory=set)

    @property
    def replayable(self) -> bool:
        """May a recovery replay it: it succeeded and is not marked ``--no-replay``."""
        return self.replay is not False and self.outcome == "ok"

    @property
    def effects(self) -> CellEffects:
        """What its code does to the namespace, read from the source."""
        return effects_of(self.source)

    @property
    def label(self) -> str:
        """``In[12]`` for a cell, ``call 7`` otherwise."""
        return f"In[{self.cell}]" if self.cell is not None else f"call {self.id}"

    def first_line(self, width: int = 48) -> str:
        text = self.source if self.shown is None else self.shown
        line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        return line if len(line) <= width else line[: width - 3] + "..."


@dataclass(frozen=True)
class Push:
    """Values the notebook pushed to the ranks (``Pool.push``, ``%fsdp push``), after journal
    entry ``after`` (0: before any) of ``epoch``: ``values`` are copies taken when they
    were pushed (the object itself where it cannot be copied); ``targets``: ``None`` for
    every rank. Pushes are not calls: a recovery does not replay them; an export writes
    them out (:mod:`._export`)."""

    after: int
    epoch: int
    values: dict[str, Any]
    targets: tuple[int, ...] | None = None


@dataclass(frozen=True)
class OutsideChange:
    """A change of the ranks' state made outside any journaled call (a panel's edit of a
    parameter, a checkpoint loaded through a panel), after entry ``after`` of ``epoch``:
    what no replay or export can do again."""

    after: int
    epoch: int
    what: str


@dataclass(frozen=True)
class Epoch:
    """One process group's life: ``base`` is the entries a recovery replayed to begin it
    (empty after a start or restart); ``snapshot``: the snapshot it was recovered to."""

    number: int
    base: tuple[JournalEntry, ...] = ()
    snapshot: str | None = None


class Journal:
    """The entries of one pool, across restarts and recoveries."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.entries: list[JournalEntry] = []
        self.epochs: list[Epoch] = [Epoch(0)]
        #: Every rank's random generators at the start and end of each entry.
        self.generators = GeneratorStates()
        #: Values pushed to the ranks, in order (:meth:`note_push`).
        self.pushes: list[Push] = []
        #: Changes of the ranks' state made outside journaled calls (:meth:`note_outside`).
        self.outside: list[OutsideChange] = []

    @property
    def epoch(self) -> Epoch:
        return self.epochs[-1]

    def begin(
        self,
        source: str,
        *,
        cell: int | None = None,
        targets: Sequence[int] | None = None,
        replay: bool | None = None,
        shown: str | None = None,
    ) -> JournalEntry:
        """A new running entry in the current epoch (``shown``: see :class:`JournalEntry`)."""
        entry = JournalEntry(
            id=next(self._ids),
            epoch=self.epoch.number,
            source=source,
            cell=cell,
            targets=None if targets is None else list(targets),
            replay=replay,
            shown=shown,
        )
        self.entries.append(entry)
        return entry

    @staticmethod
    def finish(entry: JournalEntry, outcome: str) -> None:
        if outcome not in OUTCOMES[1:]:
            raise ValueError(f"outcome must be one of {OUTCOMES[1:]}, got {outcome!r}")
        entry.outcome = outcome
        entry.seconds = time.time() - entry.started

    def new_epoch(self, base: Sequence[JournalEntry] = (), snapshot: str | None = None) -> Epoch:
        """Begin the epoch of a new group (``base``: what a recovery replayed for it)."""
        epoch = Epoch(self.epoch.number + 1, tuple(base), snapshot)
        self.epochs.append(epoch)
        return epoch

    def set_base(self, base: Sequence[JournalEntry], snapshot: str | None) -> None:
        """The current epoch, just begun by a recovery, rests on what it replayed (``base``)
        and the snapshot it restored."""
        self.epochs[-1] = Epoch(self.epoch.number, tuple(base), snapshot)

    def entry(self, entry_id: int) -> JournalEntry | None:
        return next((e for e in self.entries if e.id == entry_id), None)

    def note_snapshot(self, entry_id: int | None, snapshot_id: str) -> None:
        """Record that ``snapshot_id`` was taken during entry ``entry_id`` (if known)."""
        entry = self.entry(entry_id) if entry_id is not None else None
        if entry is not None and snapshot_id not in entry.snapshots:
            entry.snapshots.append(snapshot_id)

    def note_cell(self, notice: dict) -> None:
        """Take in what a rank reported after running an entry (a notice of kind
        ``"cell"``, see :mod:`.rank._cell_watch`): the names it rebound or reshaped, and its
        random generators at the entry's start and end."""
        entry = self.entry(notice.get("call")) if isinstance(notice.get("call"), int) else None
        if entry is None:
            return
        entry.rebound.update(str(n) for n in notice.get("rebound") or ())
        for name, why in (notice.get("reshaped") or {}).items():
            entry.reshaped.setdefault(str(name), str(why))
        rank = notice.get("rank")
        if isinstance(rank, int) and entry.replay is not False:
            self.generators.note(entry.id, rank, notice)

    def note_push(self, values: Mapping[str, Any], targets: Sequence[int] | None) -> Push:
        """Record values just pushed to ``targets`` (``None``: every rank), copied now."""
        copies = {}
        for name, value in values.items():
            try:
                copies[name] = copy.deepcopy(value)
            except Exception:  # an object that cannot be copied: kept as it is
                copies[name] = value
        last = self.entries[-1].id if self.entries else 0
        push = Push(last, self.epoch.number, copies, None if targets is None else tuple(targets))
        self.pushes.append(push)
        return push

    def note_outside(self, what: str) -> None:
        """Record a change of the ranks' state made outside any journaled call."""
        last = self.entries[-1].id if self.entries else 0
        self.outside.append(OutsideChange(last, self.epoch.number, what))

    @staticmethod
    def mark(entry: JournalEntry, mark: str) -> None:
        """Say something of ``entry`` beyond its code (see :attr:`JournalEntry.marks`)."""
        entry.marks.add(mark)

    def replay_for(self, entry_id: int | None) -> list[JournalEntry]:
        """The entries a recovery chooses from to rebuild the objects a snapshot taken
        during ``entry_id`` restores into (the recovery's slice picks among them and says
        why, :mod:`._slice`): the base of the entry's epoch, then that epoch's successful
        entries before it (those marked ``--no-replay`` too: the slice keeps them out).
        ``None`` (a snapshot taken outside any journaled call, or a checkpoint from disk):
        the current epoch's base and every successful entry of it."""
        entry = self.entry(entry_id) if entry_id is not None else None
        epoch = self.epochs[entry.epoch] if entry is not None else self.epoch
        before = [
            e
            for e in self.entries
            if e.epoch == epoch.number and e.outcome == "ok" and (entry is None or e.id < entry.id)
        ]
        return [*epoch.base, *before]

    def table(self, last: int | None = None) -> str:
        """The entries as a text table, oldest first (the last ``last`` only)."""
        shown = self.entries if last is None else self.entries[-last:]
        if not shown:
            return "(no calls yet)"
        rows = [
            (
                e.id,
                e.epoch,
                e.label,
                e.outcome,
                "-" if e.seconds is None else f"{e.seconds:.2f}s",
                {None: "auto", True: "always", False: "never"}[e.replay],
                ", ".join(e.snapshots) or "-",
                e.first_line(),
            )
            for e in shown
        ]
        headers = ("#", "epoch", "call", "outcome", "time", "replay", "snapshots", "code")
        return text_table(headers, rows)
