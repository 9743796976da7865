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

from fsdp_interactive._lazy_exports import lazy_exports
from fsdp_interactive.checkpoint.errors import (
    CheckpointBusyError,
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    SnapshotError,
    SnapshotLocationWarning,
    SnapshotObjectsError,
    SnapshotSpaceError,
    UnsupportedModelError,
    UntrustedCheckpointError,
)

_CHECKPOINT = "fsdp_interactive.checkpoint"
#: Each name exported on first use, and the module it comes from. The package imports
#: nothing of torch until one is used: its torch-free parts (the file format's checksums,
#: manifest, seals and keys, :class:`StepCounter`) serve the kernel and the engine
#: forkers, which import only those.
_LAZY = {
    "ConversionResult": f"{_CHECKPOINT}._convert",
    "from_full": f"{_CHECKPOINT}._convert",
    "to_full": f"{_CHECKPOINT}._convert",
    "SaveHandle": f"{_CHECKPOINT}._save_handle",
    "SaveResult": f"{_CHECKPOINT}._save_handle",
    "latest_checkpoint": f"{_CHECKPOINT}._checkpoint_folders",
    "list_checkpoints": f"{_CHECKPOINT}._checkpoint_folders",
    "LoadReport": f"{_CHECKPOINT}._load",
    "load": f"{_CHECKPOINT}._load",
    "CheckpointRecord": f"{_CHECKPOINT}._format._manifest",
    "RNGState": f"{_CHECKPOINT}._rng",
    "ResumableDistributedSampler": f"{_CHECKPOINT}._sampler",
    "async_save": f"{_CHECKPOINT}._save",
    "save": f"{_CHECKPOINT}._save",
    "wait_for_pending_save": f"{_CHECKPOINT}._save",
    "RestoreReport": f"{_CHECKPOINT}._snapshot",
    "SnapshotHandle": f"{_CHECKPOINT}._snapshot",
    "SnapshotRecord": f"{_CHECKPOINT}._snapshot",
    "drop_snapshots": f"{_CHECKPOINT}._snapshot",
    "list_snapshots": f"{_CHECKPOINT}._snapshot",
    "persist_snapshot": f"{_CHECKPOINT}._snapshot",
    "restore_snapshot": f"{_CHECKPOINT}._snapshot",
    "snapshot": f"{_CHECKPOINT}._snapshot",
    "PerRankStateful": f"{_CHECKPOINT}._stateful",
    "Stateful": f"{_CHECKPOINT}._stateful",
    "StepCounter": f"{_CHECKPOINT}._step_counter",
    "trust": f"{_CHECKPOINT}._trust",
}

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
    "SnapshotLocationWarning",
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

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
