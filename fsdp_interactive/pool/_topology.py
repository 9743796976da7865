"""Which engine is which rank, and the table that shows it.

Ranks are assigned deterministically from what the engines report: engines are taken
in engine-id order (with ipyparallel's MPI launcher the engine id is the MPI rank),
grouped by host in order of each host's first engine, so that the ranks of one host are
contiguous as with torchrun. ``local_rank`` counts within a host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class RankRecord:
    """One rank of a running pool (plain data, safe to show or serialise)."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    device: str
    backend: str
    engine_id: int
    address: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RankSlot:
    """The placement decided for one engine before its group starts."""

    engine_id: int
    rank: int
    local_rank: int
    local_world_size: int
    host: str
    address: str
    pid: int


def assign_ranks(engines: dict[int, dict[str, Any]]) -> list[RankSlot]:
    """Rank slots in rank order from ``{engine_id: describe_engine() result}``."""
    by_host: dict[str, list[int]] = {}
    for engine_id in sorted(engines):
        by_host.setdefault(engines[engine_id]["host"], []).append(engine_id)
    slots: list[RankSlot] = []
    for host, engine_ids in by_host.items():
        for local_rank, engine_id in enumerate(engine_ids):
            info = engines[engine_id]
            slots.append(
                RankSlot(
                    engine_id=engine_id,
                    rank=len(slots),
                    local_rank=local_rank,
                    local_world_size=len(engine_ids),
                    host=host,
                    address=info["address"],
                    pid=int(info["pid"]),
                )
            )
    return slots


_COLUMNS = ("rank", "local_rank", "host", "pid", "device", "backend", "engine_id")


def format_table(records: list[RankRecord]) -> str:
    """A fixed-width text table of the records (one row per rank)."""
    names = [f.name for f in fields(RankRecord) if f.name in _COLUMNS]
    names.sort(key=_COLUMNS.index)
    rows = [[str(getattr(r, n)) for n in names] for r in records]
    widths = [max(len(n), *(len(row[i]) for row in rows)) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)
