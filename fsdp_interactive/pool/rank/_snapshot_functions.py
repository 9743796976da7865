"""Rank side: the snapshot functions a recovery and ``stop()`` run on the ranks, returning
plain data.

The kernel names these functions (ipyparallel sends them by reference) and reads what they
return, without importing torch or ``fsdp_interactive.checkpoint``: each imports the
rank-side package only when it runs on a rank, and turns its records into dicts.
"""

from __future__ import annotations

import re
from collections.abc import Collection, MutableMapping
from typing import Any

#: Keys named in a message about a model that does not fit, at most.
_KEYS_SHOWN = 6
#: restore_snapshot's advice to pass objects, or to run the cells that define a name first,
#: which a recovery cannot take (it replaced the group: the name would be gone again).
_OBJECTS_ADVICE = re.compile(
    r"(;|, or) pass objects=\{[^}]*\}|: run the cells that define '[^']*' first"
)


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
    caller passes ``globals()`` from the cell it runs). Rank 0's report as a dict.

    A refusal is in the words of a recovery, which offers neither a partial load nor
    objects of the caller's: a snapshot of another model names the keys that differ, one
    whose objects are not all defined names them (still a :class:`SnapshotObjectsError`:
    the recovery fails on it rather than trying an older snapshot)."""
    import dataclasses

    from fsdp_interactive.checkpoint import (
        IncompatibleCheckpointError,
        SnapshotError,
        SnapshotObjectsError,
        restore_snapshot,
    )

    try:
        report = restore_snapshot(source, namespace)
    except SnapshotError as error:
        text = _OBJECTS_ADVICE.sub("", str(error))
        if text == str(error):
            raise
        if isinstance(error, SnapshotObjectsError):  # the recovery names what is not there
            raise SnapshotObjectsError(text, error.missing) from None
        raise SnapshotError(text) from None
    except IncompatibleCheckpointError as error:
        if not (error.missing_keys or error.unexpected_keys):
            raise
        raise IncompatibleCheckpointError(
            key_mismatch(source, error.missing_keys, error.unexpected_keys),
            missing_keys=error.missing_keys,
            unexpected_keys=error.unexpected_keys,
        ) from None
    return dataclasses.asdict(report) if dataclasses.is_dataclass(report) else dict(report)


def restore_here(source: str) -> dict[str, Any]:
    """:func:`restore_into` this engine's user namespace (what a recovery runs on every rank
    with ``Pool.call``: one round trip, no cell and no variable left behind), with the
    public names the namespace then holds under ``"defined"`` (for the recovery's report)."""
    from fsdp_interactive.pool.rank._cell_watch import public_names
    from fsdp_interactive.pool.rank._engine_shell import user_namespace

    namespace = user_namespace()
    report = restore_into(source, namespace)
    report["defined"] = public_names(namespace)
    return report


def check_folder_source(folder: str) -> str | None:
    """What a recovery to the checkpoint folder ``folder`` would refuse, found on this rank
    before anything ends and without reading any tensor: a folder that is not a complete
    checkpoint, a checkpoint without a snapshot record (it names no objects to load into),
    a damaged record, or model keys that do not fit the model this rank holds under the
    recorded name. ``None`` when none of these is found (a name not defined now is not
    judged: the replay may define it); not collective."""
    from pathlib import Path

    from torch import nn

    from fsdp_interactive.checkpoint import CheckpointError
    from fsdp_interactive.checkpoint._load import check_folder
    from fsdp_interactive.checkpoint._model_state import model_state
    from fsdp_interactive.checkpoint._snapshot._store import RECORD_FILE, read_folder_record
    from fsdp_interactive.pool.rank._engine_shell import user_namespace

    path = Path(folder)
    try:
        check_folder(path)
        if not (path / RECORD_FILE).is_file():
            return (
                f"{folder} is a checkpoint saved by checkpoint.save, not a snapshot: it "
                "names no variables to load into (load it on the ranks with "
                "fsdp_interactive.checkpoint.load(folder, model, optimizer))"
            )
        record = read_folder_record(path)
    except CheckpointError as error:
        return f"{folder} cannot be recovered to: {error}"
    model = user_namespace().get(str(record.names.get("model") or ""))
    if not isinstance(model, nn.Module):
        return None
    try:  # clean names, as the record keeps them, also of a model inside its wrappers
        live, saved = set(model_state(model)), set(record.keys)
    except CheckpointError as error:
        return f"{folder} cannot be recovered to: {error}"
    if live == saved:
        return None
    return key_mismatch(folder, sorted(live - saved), sorted(saved - live))


def key_mismatch(source: str, missing: Collection[str], unexpected: Collection[str]) -> str:
    """``source`` is of another model: the keys the model has and it lacks (``missing``)
    and those it has that the model lacks (``unexpected``), the first few of each."""

    def shown(keys: Collection[str]) -> str:
        first = sorted(keys)[:_KEYS_SHOWN]
        more = len(keys) - len(first)
        return ", ".join(first) + (f" and {more} more" if more else "")

    parts = []
    if missing:
        parts.append(f"the model has {len(missing)} keys it lacks ({shown(missing)})")
    if unexpected:
        parts.append(f"it has {len(unexpected)} keys the model lacks ({shown(unexpected)})")
    return (
        f"{source} was taken of another model: "
        + "; ".join(parts)
        + ". Recover to a snapshot of this model, or rebuild the model it was taken of"
    )
