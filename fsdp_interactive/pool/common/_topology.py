"""Which engine is which rank, and the table that shows it.

Ranks are assigned deterministically from what the engines report: engines are taken
in the order their launcher started them when it says (:data:`LAUNCH_ORDER_ENV`: the
pool's ssh engines, forked on all hosts at once, are numbered in the order of
``SSHEngineSetLauncher.engines``), else in engine-id order (with ipyparallel's MPI
launcher the engine id is the MPI rank), grouped by host in order of each host's first
engine, so that the ranks of one host are contiguous as with torchrun. ``local_rank``
counts within a host.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from fsdp_interactive._text import text_table

#: The environment variable in which a launcher numbers the engines it starts (0, 1, ...).
LAUNCH_ORDER_ENV = "FSDPI_LAUNCH_ORDER"


def launch_order() -> int | None:
    """This engine's :data:`LAUNCH_ORDER_ENV` (``None``: not set, or not a number)."""
    try:
        return int(os.environ[LAUNCH_ORDER_ENV])
    except (KeyError, ValueError):
        return None


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
    #: The ``CUDA_VISIBLE_DEVICES`` the rank runs under when the pool set it (the devices
    #: of its host's ranks, in local-rank order); ``None``: left as the host had it.
    visible_devices: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict of its fields."""
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

    def started(engine_id: int) -> tuple[bool, int, int]:
        order = engines[engine_id].get("launch_order")
        return (order is None, order if isinstance(order, int) else 0, engine_id)

    for engine_id in sorted(engines, key=started):
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


def _cell(record: RankRecord, name: str) -> str:
    if name == "device" and record.visible_devices is not None:
        return f"{record.device} (of {record.visible_devices})"
    return str(getattr(record, name))


def format_table(records: list[RankRecord]) -> str:
    """A fixed-width text table of the records (one row per rank). A CUDA rank that runs
    under a ``CUDA_VISIBLE_DEVICES`` the pool set shows it beside its device:
    ``cuda:1 (of 1,3)`` is the second of devices 1 and 3 of its host."""
    names = sorted((f.name for f in fields(RankRecord) if f.name in _COLUMNS), key=_COLUMNS.index)
    return text_table(names, [[_cell(r, n) for n in names] for r in records])
