"""Every rank's random generators at the start and end of each journal entry (kernel side):
a replay starts each cell with the generators the original started with, and leaves them as
the original left them (which matters when the replay skipped drawing initial weights).

A rank reports them after each cell (:mod:`.rank._cell_watch`) as plain data (bytes and
ints: the kernel never unpickles a tensor and never imports torch): torch's CPU generator,
the rank's CUDA device's where CUDA is in use, Python's ``random`` and NumPy's global
generator where NumPy is imported, about 11 KB in all. Each distinct state is kept once,
under a digest the rank computes: ranks seeded alike share their states, and so do a cell's
end and the next cell's start when nothing drew between them; a rank sends a state it sent
before by its digest only.

Faults: the states live in the kernel, so a dead rank or a lost host leaves them whole. A
rank that died before its report of a cell reached the kernel has no states for that cell:
its replay runs that cell with the generators as they are (the recovery's report says so).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: A rank's generators at one moment, as :mod:`.rank._cell_watch` captures them.
State = dict[str, Any]


class GeneratorStates:
    """The generators' states of a pool's journal entries, by entry and rank."""

    def __init__(self) -> None:
        self._states: dict[str, State] = {}
        self._by_entry: dict[int, dict[int, tuple[str | None, str | None]]] = {}

    def note(self, entry_id: int, rank: int, report: Mapping[str, Any]) -> None:
        """Keep what ``rank`` reported for entry ``entry_id``: ``rng_start`` and ``rng_end``
        (digests) and ``states`` (digest -> state, the ones not sent before)."""
        for digest, state in (report.get("states") or {}).items():
            if isinstance(state, dict):
                self._states.setdefault(str(digest), state)
        start, end = report.get("rng_start"), report.get("rng_end")
        self._by_entry.setdefault(entry_id, {})[rank] = (
            start if start in self._states else None,
            end if end in self._states else None,
        )

    def of(self, entry_id: int, rank: int) -> tuple[State | None, State | None]:
        """``(start, end)`` of ``rank`` in entry ``entry_id`` (``None`` where not known)."""
        start, end = self._by_entry.get(entry_id, {}).get(rank, (None, None))
        return self._states.get(start or ""), self._states.get(end or "")

    def digests(self, entry_id: int, rank: int) -> tuple[str | None, str | None]:
        """The digests of ``(start, end)`` of ``rank`` in entry ``entry_id`` (an export
        sets the generators only where a cell started from other states than the previous
        one left)."""
        return self._by_entry.get(entry_id, {}).get(rank, (None, None))

    def ranks_of(self, entry_id: int) -> set[int]:
        """The ranks whose generators are known for entry ``entry_id``."""
        return set(self._by_entry.get(entry_id, {}))

    def for_replay(self, entry_ids: Iterable[int], rank: int) -> dict[int, dict[str, Any]]:
        """What rank ``rank`` of a replay needs: ``{entry: {"start": state, "end": state}}``
        for the entries whose states it reported (an original rank of the same number)."""
        plan = {}
        for entry_id in entry_ids:
            start, end = self.of(entry_id, rank)
            if start is not None or end is not None:
                plan[entry_id] = {"start": start, "end": end}
        return plan

    def __len__(self) -> int:
        """Distinct states kept."""
        return len(self._states)
