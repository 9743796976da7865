"""Snapshots of the training state in host memory, for recovering from a fault in seconds.

Rank side. A snapshot is a DCP checkpoint in each host's snapshot folder (shared memory
under ``/dev/shm`` in a pool), which outlives the rank processes; with ranks on several
hosts each host also keeps a copy of the previous host's files (a ring), so a lost host
loses no file. Modules, one concept each:

* :mod:`._take` (:func:`snapshot`), :mod:`._plan` (hosts, id, room, folders),
  :mod:`._publish` (checksums, ring copy, descriptions, publish, rotation, notice);
* :mod:`._restore` (:func:`restore_snapshot`), :mod:`._locate` (finding a snapshot on the
  hosts and completing every host), :mod:`._persist` (:func:`persist_snapshot`);
* :mod:`._store` (one host's folder: :func:`list_snapshots`, :func:`drop_snapshots`),
  :mod:`._place` (roots, hosts, the ring), :mod:`._room` (free space),
  :mod:`._object_locations` (variable names by identity), :mod:`._transfer` (files over
  gloo), :mod:`._snapshot_handle`.

The files a snapshot writes (its record, seal, manifest, raw storage) are the checkpoint
format's (:mod:`.._format`).
"""

from __future__ import annotations

from fsdp_interactive.checkpoint._format._snapshot_record import SnapshotRecord
from fsdp_interactive.checkpoint._snapshot._persist import persist_snapshot
from fsdp_interactive.checkpoint._snapshot._restore import RestoreReport, restore_snapshot
from fsdp_interactive.checkpoint._snapshot._snapshot_handle import SnapshotHandle
from fsdp_interactive.checkpoint._snapshot._store import drop_snapshots, list_snapshots
from fsdp_interactive.checkpoint._snapshot._take import snapshot

__all__ = [
    "RestoreReport",
    "SnapshotHandle",
    "SnapshotRecord",
    "drop_snapshots",
    "list_snapshots",
    "persist_snapshot",
    "restore_snapshot",
    "snapshot",
]
