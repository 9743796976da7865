"""Live checkpoints of a sharded training state, on ``torch.distributed.checkpoint``.

Rank side: every function here is called on every rank (collectively) unless noted, and
returns plain dataclasses a notebook panel can display.

* :func:`save` / :func:`async_save` (-> :class:`SaveHandle`): model + optimizer + JSON
  ``extra`` + ``stateful`` objects (LR schedulers, :class:`RNGState`,
  :class:`ResumableDistributedSampler`, anything with ``state_dict``/``load_state_dict``),
  every rank writing its own shards; atomic publish; ``keep_last`` rotation. One
  pipeline, run in the calling thread or, after staging, in the background.
* :func:`load` (-> :class:`LoadReport`): all-or-nothing, any world size (resharding,
  per-rank Stateful states included), strict or reporting key checks, checksums, no
  arbitrary unpickling.
* Any wrapping torch's state-dict helpers know (``fully_shard``, this package's
  wrapper, torch FSDP1 flat or with original parameters, DDP, ``torch.compile``,
  activation checkpointing) and Lightning Fabric's module: values are keyed by clean
  FQNs, so a checkpoint of one wrapping loads into another of the same architecture;
  what torch cannot checkpoint raises :class:`UnsupportedModelError`.
* Private and sealed: folders 0700 and files 0600 unless ``mode=`` asks otherwise, the
  manifest sealed with the user's checkpoint key; :func:`load` refuses a checkpoint
  another user could have changed or did not seal (:class:`UntrustedCheckpointError`),
  unless ``trusted=True``; :func:`trust` seals one the user vouches for.
* :func:`list_checkpoints` / :func:`latest_checkpoint` (plain file reads, any process).
* :func:`to_full` / :func:`from_full` (one process, no process group): convert between
  a checkpoint and a plain state-dict file (safetensors or ``torch.save``).
* :func:`snapshot` (-> :class:`SnapshotRecord` or :class:`SnapshotHandle`),
  :func:`restore_snapshot` (-> :class:`RestoreReport`), :func:`persist_snapshot`,
  :func:`list_snapshots`, :func:`drop_snapshots`: snapshots in host memory (shared memory
  that outlives the ranks, a copy of each host's files on the next host), to recover from
  a dead rank, a wedged collective or a lost host in seconds.

Log records (``logging.getLogger("fsdp_interactive.checkpoint")``, INFO and DEBUG, silent
unless configured) follow each save and load: plan, capture sizes, per-rank write
times, manifest, publish, rotation, what a load found and how it resharded.
"""

from __future__ import annotations

from fsdp_interactive._lazy_exports import public_names
from fsdp_interactive._step_counter import StepCounter
from fsdp_interactive.checkpoint._convert import ConversionResult, from_full, to_full
from fsdp_interactive.checkpoint._handle import SaveHandle, SaveResult
from fsdp_interactive.checkpoint._layout import latest_checkpoint, list_checkpoints
from fsdp_interactive.checkpoint._load import LoadReport, load
from fsdp_interactive.checkpoint._manifest import CheckpointRecord
from fsdp_interactive.checkpoint._rng import RNGState
from fsdp_interactive.checkpoint._sampler import ResumableDistributedSampler
from fsdp_interactive.checkpoint._save import async_save, save, wait_for_pending_save
from fsdp_interactive.checkpoint._snapshot import (
    RestoreReport,
    SnapshotHandle,
    SnapshotRecord,
    drop_snapshots,
    list_snapshots,
    persist_snapshot,
    restore_snapshot,
    snapshot,
)
from fsdp_interactive.checkpoint._stateful import PerRankStateful, Stateful
from fsdp_interactive.checkpoint._trust import trust
from fsdp_interactive.checkpoint.errors import (
    CheckpointBusyError,
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    SnapshotError,
    SnapshotObjectsError,
    SnapshotSpaceError,
    UnsupportedModelError,
    UntrustedCheckpointError,
)

__all__ = [
    "CheckpointBusyError",
    "CheckpointError",
    "CheckpointPathError",
    "CheckpointRecord",
    "ConversionResult",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "LoadReport",
    "PerRankStateful",
    "RNGState",
    "RestoreReport",
    "ResumableDistributedSampler",
    "SaveHandle",
    "SaveResult",
    "SnapshotError",
    "SnapshotHandle",
    "SnapshotObjectsError",
    "SnapshotRecord",
    "SnapshotSpaceError",
    "Stateful",
    "StepCounter",
    "UnsupportedModelError",
    "UntrustedCheckpointError",
    "async_save",
    "drop_snapshots",
    "from_full",
    "latest_checkpoint",
    "list_checkpoints",
    "list_snapshots",
    "load",
    "persist_snapshot",
    "restore_snapshot",
    "save",
    "snapshot",
    "to_full",
    "trust",
    "wait_for_pending_save",
]

__dir__ = public_names(__name__)
