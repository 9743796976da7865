"""Rank side: the snapshot functions a recovery and ``stop()`` run on the ranks, returning
plain data.

The kernel names these functions (ipyparallel sends them by reference) and reads what they
return, without importing torch or ``fsdp_interactive.checkpoint``: each imports the
rank-side package only when it runs on a rank, and turns its records into dicts.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any


def held_here() -> list[dict[str, Any]]:
    """The records of the snapshots this rank's host holds (``list_snapshots``), oldest
    first; not collective."""
    from fsdp_interactive.checkpoint import list_snapshots

    return [record.to_dict() for record in list_snapshots()]


def drop_here() -> list[str]:
    """Free this rank's host's snapshots (``drop_snapshots``); the removed paths."""
    from fsdp_interactive.checkpoint import drop_snapshots

    return drop_snapshots()


def restore_into(source: str, namespace: MutableMapping[str, Any]) -> dict[str, Any]:
    """``restore_snapshot(source, namespace)`` on every rank (collective): ``source`` a
    snapshot id or a checkpoint folder, ``namespace`` the engine's user namespace (the
    caller passes ``globals()`` from the cell it runs). Rank 0's report as a dict."""
    import dataclasses

    from fsdp_interactive.checkpoint import restore_snapshot

    report = restore_snapshot(source, namespace)
    return dataclasses.asdict(report) if dataclasses.is_dataclass(report) else dict(report)
