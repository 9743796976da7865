"""What ``recover`` checks before it ends anything, so that input it refuses leaves the
pool exactly as it was (every variable on the ranks still there); a dry run runs the
same checks.

In the kernel, on what the user named (``from_`` / ``--from``, ``world`` / ``--world``):

* a world size: no more ranks than the pool has devices for;

* a folder: it exists and holds a checkpoint's manifest; it holds a snapshot record (a
  plain checkpoint of ``checkpoint.save`` names no variables to load into, so a
  recovery cannot use it); the record is intact JSON naming the model and its keys.

On the ranks, when they run and no earlier call keeps them busy (after a rank died, or
with ranks blocked in a wedged collective, the ranks cannot be asked: what only they can
tell is then found during the recovery, which tries an older snapshot or reports it):

* a folder: each rank reads its manifest and DCP metadata and the record, and compares
  the record's model keys with those of the model it holds under the recorded name
  (:func:`~.rank._snapshot_functions.check_folder_source`);
* a snapshot: some host of the group holds it, with an intact record (a snapshot whose
  record is damaged is not listed); without a named one, the hosts hold some snapshot.

A snapshot named by id is not compared with the live objects: its recovery replays the
cells before the one that took it, which build the objects it was taken of, whatever the
names hold now.

In the kernel, on the plan (:func:`check_findable`): every variable the snapshot restores
into (the root of each recorded location) is bound by a call the replay runs. One that
only a ``--no-replay`` cell, the cell that took the snapshot, a later cell or
``Pool.push`` bound would not be there after the replay, and the restore would fail after
the group was replaced: refused before anything ends, naming who binds it and an older
snapshot that a recovery can restore, if there is one.

Faults: the checks only read; a rank that dies while they ask raises ``RankDied`` with
the pool broken as it would be anyway.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fsdp_interactive import _private_files
from fsdp_interactive.pool._journal import Journal
from fsdp_interactive.pool._slice import ReplaySlice, roots_of, slice_for
from fsdp_interactive.pool._snapshots import SnapshotBook, SnapshotInfo, held_snapshots
from fsdp_interactive.pool.errors import RESTART, RecoveryError, Step
from fsdp_interactive.pool.rank._snapshot_functions import check_folder_source

#: A :class:`~._pool.Pool` (not imported: the pool imports this module).
Pool = Any

#: The files that make a folder a checkpoint, and a snapshot's (the names
#: ``fsdp_interactive.checkpoint`` writes; the kernel does not import it, which imports torch).
MANIFEST_FILE = "manifest.json"
RECORD_FILE = "snapshot.json"
_UNCHANGED = "nothing was changed"

TAKE_SNAPSHOT = Step(
    "take one with {}",
    "fsdp_interactive.snapshot(model=..., optimizer=...) on the ranks",
    "%fsdp snapshot MODEL OPTIMIZER (or fsdp_interactive.snapshot(model=..., optimizer=...) "
    "in a cell)",
)
FROM_FOLDER = Step(
    "name a folder a snapshot was persisted to with {}",
    "pool.recover(from_=FOLDER)",
    "%fsdp recover --from DIR",
)
PERSIST = Step(
    "write one with {}",
    "fsdp_interactive.checkpoint.persist_snapshot(ID, DIR) on the ranks",
    "%fsdp snapshot --persist DIR",
)
NEWEST = Step("recover to the newest snapshot with {}", "pool.recover()", "%fsdp recover")


def check_world(pool: Pool, world: int | None) -> None:
    """Refuse a ``world`` of more ranks than the pool's devices (CUDA ranks)."""
    devices = pool._request.devices
    if world is not None and isinstance(devices, tuple) and world > len(devices):
        raise RecoveryError(
            f"{world} ranks need more devices than the pool's {list(devices)}; {_UNCHANGED}"
        )


def ranks_can_answer(pool: Pool) -> bool:
    """Whether the ranks can be asked now: the group runs and no rank is busy."""
    return bool(pool.running and not pool.busy_ranks())


def check_folder(pool: Pool, folder: str) -> None:
    """Refuse (:class:`RecoveryError`) the checkpoint folder ``folder`` unless it is a
    persisted snapshot a recovery can load into the live objects (module docstring)."""
    if not os.path.isdir(folder):
        raise RecoveryError(f"no checkpoint folder {folder!r}; {_UNCHANGED}")
    if not os.path.isfile(os.path.join(folder, MANIFEST_FILE)):
        raise RecoveryError(
            f"{folder} is not a checkpoint folder (it holds no {MANIFEST_FILE}); {_UNCHANGED}",
            PERSIST,
        )
    record = os.path.join(folder, RECORD_FILE)
    if not os.path.isfile(record):
        raise RecoveryError(
            f"{folder} is a checkpoint saved by checkpoint.save, not a snapshot: it names no "
            "variables to load into (load it on the ranks with "
            f"fsdp_interactive.checkpoint.load(folder, model, optimizer)); {_UNCHANGED}",
            PERSIST,
        )
    damage = _record_damage(record)
    if damage:
        raise RecoveryError(f"the snapshot record {record} is damaged ({damage}); {_UNCHANGED}")
    if not ranks_can_answer(pool):
        return
    problems = pool.call(check_folder_source, folder)
    found = next((problem for problem in problems if problem), None)
    if found:
        raise RecoveryError(f"{found}; {_UNCHANGED}", PERSIST)


def _record_damage(path: str) -> str:
    """What is wrong with the snapshot record file ``path`` ("": nothing seen here)."""
    try:  # no link followed, no wait on a FIFO, a bounded size: it may have been planted
        data = json.loads(_private_files.read_regular(path))
    except (OSError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    if not isinstance(data, dict):
        return "not a JSON object"
    missing = [key for key in ("id", "names", "keys") if key not in data]
    return f"no {', '.join(missing)}" if missing else ""


def check_snapshot(pool: Pool, snapshot: SnapshotInfo, *, pinned: bool) -> None:
    """Refuse (:class:`RecoveryError`) when the running ranks' hosts do not hold
    ``snapshot`` (``pinned``: the caller named it) or, otherwise, hold no snapshot."""
    if not ranks_can_answer(pool):
        return
    held = held_snapshots(pool)
    listed = ", ".join(sorted(held)) or "none"
    if pinned and snapshot.id not in held:
        raise RecoveryError(
            f"snapshot {snapshot.id} is not held by any host of the group (held: {listed}): "
            f"it was rotated away, or its record is damaged; {_UNCHANGED}",
            *((NEWEST,) if held else (TAKE_SNAPSHOT,)),
        )
    if not held:
        raise RecoveryError(
            f"the hosts of the group hold no snapshot (the kernel heard of {snapshot.id}, "
            f"which is gone); {_UNCHANGED}",
            TAKE_SNAPSHOT,
        )


def _unfound(journal: Journal, snapshot: SnapshotInfo, sliced: ReplaySlice) -> list[str]:
    """Each variable ``snapshot`` restores into that no entry of ``sliced``'s replay binds,
    with who binds it and why that is not replayed."""
    roots = roots_of(snapshot.names) or {}
    problems = []
    for root, what in roots.items():
        if sliced.defines(root):
            continue
        binder = next(
            (
                e
                for e in reversed(journal.entries)
                if e.outcome != "running" and (root in e.effects.defines or root in e.rebound)
            ),
            None,
        )
        if binder is None:
            why = (
                "no %%fsdp cell or Pool.run call binds it (Pool.push, %fsdp push or Pool.call did)"
            )
        elif binder.id == snapshot.call:
            why = f"only {binder.label}, the call that took the snapshot, binds it"
        elif snapshot.call is not None and binder.id > snapshot.call:
            why = f"only {binder.label}, after the snapshot was taken, binds it"
        elif binder.replay is False:
            why = f"only {binder.label} binds it, and {binder.label} is marked --no-replay"
        elif binder.outcome != "ok":
            why = f"only {binder.label} binds it, and it ended with {binder.outcome}"
        else:
            why = f"{binder.label} binds it, but not among the calls the replay runs"
        problems.append(f"{root!r} ({what}): {why}")
    return problems


def check_findable(
    journal: Journal, book: SnapshotBook, snapshot: SnapshotInfo, sliced: ReplaySlice
) -> None:
    """Refuse (:class:`RecoveryError`, nothing changed) a recovery to ``snapshot`` whose
    replay (``sliced``) would not bind every variable it restores into (module docstring);
    the error names an older snapshot a recovery can restore, when the kernel knows one."""
    problems = _unfound(journal, snapshot, sliced)
    if not problems:
        return
    older = None
    for candidate in reversed(book.all()):
        if candidate.id >= snapshot.id or roots_of(candidate.names) is None:
            continue
        if not _unfound(
            journal, candidate, slice_for(journal.replay_for(candidate.call), candidate.names)
        ):
            older = candidate
            break
    steps = (
        [
            Step(
                f"recover to the older snapshot {older.id} (of {older.holding}) with {{}}",
                f"pool.recover({older.id!r})",
                f"%fsdp recover --from {older.id}",
            )
        ]
        if older is not None
        else []
    )
    raise RecoveryError(
        f"{snapshot.describe()} cannot be recovered to: a recovery replays the calls before "
        "the one that took it that bind what it restores into, and none binds "
        + "; ".join(problems)
        + f"; {_UNCHANGED}. A snapshot finds its objects again when it is given them where "
        "a replayed cell keeps them (model=run.model).",
        *steps,
        RESTART,
    )
