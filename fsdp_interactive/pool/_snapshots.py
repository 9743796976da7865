"""What the kernel knows of the ranks' snapshots (kernel side).

A snapshot lives in the memory of the ranks' hosts (``fsdp_interactive.snapshot``, under
the pool's snapshot root on every host, see :mod:`.common._snapshot_root`); the kernel
never reads it. It learns of each one from the notice rank 0 sends once the snapshot is published
(:mod:`fsdp_interactive._notices`), and, after a fault, from what the ranks of the new
group find on their hosts. :class:`SnapshotBook` keeps those records for the journal,
``%fsdp recover --dry-run`` and the panels.

Faults: the book is the kernel's, so it survives a dead rank, a wedged collective and a
lost host; it may then name a snapshot that is gone (its only copies were on the lost
host) or miss the newest (its notice was lost with the rank that sent it). A recovery
therefore asks the ranks what their hosts hold, and trusts that over the book.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fsdp_interactive._text import snapshot_objects
from fsdp_interactive.pool.rank._snapshot_functions import held_here

#: A :class:`~._pool.Pool` (not imported: the pool imports this module).
Pool = Any


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot as the kernel knows it (the plain fields of the ranks' record).

    ``id`` sorts by age (``s000004``); ``step``: the training step it was taken at, if
    given; ``created``: wall-clock time on rank 0's host; ``call``: the journal entry it was
    taken during (``None``: outside a journaled call); ``names``: the variables holding the
    model, the optimizer and each stateful object; ``hosts``: each rank's host;
    ``dropped``: the snapshots of the same objects that taking it removed (``keep_last``),
    each as ``s000006 (model, optim)``.
    """

    id: str
    step: int | None = None
    created: float = 0.0
    world_size: int = 0
    call: int | None = None
    hosts: tuple[str, ...] = ()
    names: Mapping[str, Any] = field(default_factory=dict)
    bytes_per_host: Mapping[str, int] = field(default_factory=dict)
    seconds: float | None = None
    dropped: tuple[str, ...] = ()
    #: Every location of the modules it holds when it was taken (``model``, ``trainer.model``).
    held_at: tuple[str, ...] = ()

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> SnapshotInfo:
        """From a rank's record (a notice or ``list_snapshots`` entry, as a mapping)."""
        call = record.get("call")
        step = record.get("step")
        return cls(
            id=str(record["id"]),
            step=None if step is None else int(step),
            created=float(record.get("created") or 0.0),
            world_size=int(record.get("world_size") or 0),
            call=None if call is None else int(call),
            hosts=tuple(record.get("hosts") or ()),
            names=dict(record.get("names") or {}),
            bytes_per_host={
                str(k): int(v) for k, v in (record.get("bytes_per_host") or {}).items()
            },
            seconds=record.get("seconds"),
            dropped=tuple(str(d) for d in record.get("dropped") or ()),
            held_at=tuple(str(w) for w in record.get("held_at") or ()),
        )

    @property
    def holding(self) -> str:
        """The objects it holds, by where they were: ``model, optim, sched``."""
        return snapshot_objects(dict(self.names))

    def age(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.created)

    def describe(self, now: float | None = None) -> str:
        """``snapshot s000004 of step 40 (taken 12 s ago)``."""
        step = f" of step {self.step}" if self.step is not None else ""
        return f"snapshot {self.id}{step} (taken {_age_text(self.age(now))} ago)"

    def taken_line(self) -> str:
        """What taking it did, without its age (a status that stays true):
        ``took snapshot s000007 of step 30 of model, optim; dropped s000006 (model, optim)``."""
        step = f" of step {self.step}" if self.step is not None else ""
        dropped = f"; dropped {', '.join(self.dropped)}" if self.dropped else ""
        return f"took snapshot {self.id}{step} of {self.holding}{dropped}"


def _age_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class SnapshotBook:
    """The snapshots the kernel has heard of, by id."""

    def __init__(self) -> None:
        self._known: dict[str, SnapshotInfo] = {}

    def add(self, records: Iterable[Mapping[str, Any]]) -> list[SnapshotInfo]:
        """Take in records (notices of kind ``"snapshot"`` or listings); the new ones."""
        added = []
        for record in records:
            if record.get("kind", "snapshot") != "snapshot" or "id" not in record:
                continue
            info = SnapshotInfo.from_record(record)
            if info.dropped:  # named with what they held, while the book still knows
                info = replace(info, dropped=tuple(self._named(d) for d in info.dropped))
            if info.id not in self._known:
                added.append(info)
            self._known[info.id] = info
        return added

    def _named(self, snapshot_id: str) -> str:
        known = self._known.get(snapshot_id)
        return f"{snapshot_id} ({known.holding})" if known is not None else snapshot_id

    def forget(self, keep: Iterable[str]) -> None:
        """Drop every snapshot but those in ``keep`` (what the hosts still hold)."""
        kept = set(keep)
        self._known = {k: v for k, v in self._known.items() if k in kept}

    def clear(self) -> None:
        self._known = {}

    def get(self, snapshot_id: str) -> SnapshotInfo | None:
        return self._known.get(snapshot_id)

    def all(self) -> list[SnapshotInfo]:
        """Oldest first."""
        return [self._known[k] for k in sorted(self._known)]

    def latest(self) -> SnapshotInfo | None:
        return self._known[max(self._known)] if self._known else None


def held_snapshots(pool: Pool) -> dict[str, SnapshotInfo]:
    """Every snapshot some host of ``pool``'s running group holds (each rank lists its
    host's); the kernel's book learns of them too."""
    listings = pool.call(held_here)
    held = held_in(listings)
    pool._snapshot_book.add(asdict(info) for info in held.values())
    return held


def held_in(listings: Sequence[Sequence[Any]]) -> dict[str, SnapshotInfo]:
    """Every snapshot some rank's host holds, from each rank's ``list_snapshots()``."""
    held: dict[str, SnapshotInfo] = {}
    for listing in listings:
        for record in listing:
            info = SnapshotInfo.from_record(record)
            held.setdefault(info.id, info)
    return held
