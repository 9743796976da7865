"""An attached job's ranks at one moment, as plain data: each rank's state, the table that
shows them, and the report of ranks that wait in a collective too long.

The ranks build :class:`RankState` (:mod:`pool.rank._job_phase`) from their own thread
stacks, flight recorder and memory, without stopping; the kernel shows them
(:func:`status_text`) and tells a hang from them (:func:`hang_lines`). Free of torch,
IPython and ipyparallel: both sides import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_interactive._text import human_bytes, text_table

#: Phases a rank reports.
FORWARD, BACKWARD, OPTIMIZER, PAUSED, OUTSIDE = (
    "forward",
    "backward",
    "optimizer",
    "paused",
    "outside training",
)


@dataclass(frozen=True)
class RankState:
    """One rank of a job: where it is and what it holds.

    ``step``: optimizer steps it completed; ``phase``: one of ``forward``, ``backward``,
    ``optimizer``, ``paused``, ``outside training``; ``where``: its training thread's
    innermost line ("in all_reduce (distributed_c10d.py:2950), ..."); ``collective``: the
    collective it waits in ("all_reduce #12"), ``None`` when none; ``waiting_s``: for how
    long (from its flight recorder); ``pause_target``: the step it will pause after, when
    a pause is asked; memory in bytes: ``rss_bytes`` of the process, the CUDA allocator's
    ``allocated_bytes``/``reserved_bytes`` on ``device`` (``None`` on a CPU rank).
    """

    rank: int
    host: str
    pid: int
    step: int
    phase: str
    where: str
    collective: str | None = None
    waiting_s: float | None = None
    pause_target: int | None = None
    rss_bytes: int = 0
    device: str = "cpu"
    backend: str = "-"
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None

    @property
    def phase_text(self) -> str:
        """``in collective all_reduce #12 (backward), 3.2 s`` or the phase alone."""
        if self.collective is None:
            return self.phase
        text = f"in collective {self.collective} ({self.phase})"
        if self.waiting_s is not None:
            text += f", {self.waiting_s:.1f} s"
        return text


STATUS_HEADERS = ("rank", "host", "pid", "step", "phase", "rss", "device", "allocated")


def status_rows(states: Sequence[RankState]) -> list[tuple[str, ...]]:
    return [
        (
            str(s.rank),
            s.host,
            str(s.pid),
            str(s.step),
            s.phase_text,
            human_bytes(s.rss_bytes),
            s.device,
            human_bytes(s.allocated_bytes),
        )
        for s in sorted(states, key=lambda s: s.rank)
    ]


def status_text(states: Sequence[RankState], gone: dict[int, str] | None = None) -> str:
    """The ranks as a table; ``gone`` maps ranks that did not answer to why."""
    rows = status_rows(states)
    for rank, why in sorted((gone or {}).items()):
        rows.append((str(rank), "-", "-", "-", why, "-", "-", "-"))
    rows.sort(key=lambda row: int(row[0]))
    return text_table(STATUS_HEADERS, rows)


def waiting_ranks(states: Sequence[RankState], threshold_s: float) -> list[RankState]:
    """The ranks that have waited in a collective for ``threshold_s`` seconds or more."""
    return [
        s
        for s in states
        if s.collective is not None and s.waiting_s is not None and s.waiting_s >= threshold_s
    ]


def hang_lines(states: Sequence[RankState], threshold_s: float) -> list[str]:
    """One line per rank that waits in a collective past ``threshold_s``, then one per
    rank that does not (where it is instead); empty when none waits that long."""
    waiting = waiting_ranks(states, threshold_s)
    if not waiting:
        return []
    lines = [
        f"rank {s.rank} has waited {s.waiting_s:.0f} s in {s.collective} ({s.phase}): {s.where}"
        for s in waiting
    ]
    held = {s.rank for s in waiting}
    for state in sorted(states, key=lambda s: s.rank):
        if state.rank not in held:
            lines.append(
                f"rank {state.rank} is at step {state.step}, {state.phase_text}: {state.where}"
            )
    return lines
