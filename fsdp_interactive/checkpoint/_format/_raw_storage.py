"""A DCP storage format of raw tensor bytes: what snapshots write (and any reader of
``_safe_reader`` reads back, also after :func:`persist_snapshot`).

DCP's ``FileSystemWriter`` frames every tensor with ``torch.save`` (a zip archive and a
pickle per tensor), and its reader unpacks each with ``torch.load`` into a new tensor that
is then copied into the target. For a snapshot in host memory that framing is most of the
cost. :class:`RawWriter` is a ``torch.distributed.checkpoint.StorageWriter`` (DCP's
public storage interface: planning, resharding metadata and the collectives stay DCP's)
that writes, per rank, one file ``__<rank>_0.distcp`` holding each item's bytes as they are
in memory: a tensor's elements (C order, its dtype), a non-tensor item's ``torch.save``
bytes (DCP's own serialization of plain values). Where each item lives is a
:class:`RawExtent` in the DCP metadata; its dtype and shape are the metadata's own.
The reader (:class:`~._safe_reader.RawReader`) reads each chunk straight into the target
tensor when the target's memory is laid out like the chunk (the same world size: every
shard), else into one buffer that is narrowed and copied (resharding).

The writer computes each file's checksum (:data:`~._manifest.SNAPSHOT_CHECKSUM`) on the
bytes it writes, while they are in the cache: nothing is read back. Files are created new
(``O_EXCL | O_NOFOLLOW``, mode 0600) in the folder, opened once without following a link:
nothing is written through a link someone placed. What is not done here: choosing the
folder, publishing it, the manifest (the callers').
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from fsdp_interactive import _private_files
from fsdp_interactive.checkpoint._format import _manifest
from fsdp_interactive.checkpoint._format._checksums import new_checksum

#: The DCP metadata file's name (DCP's own).
METADATA_FILE = ".metadata"
#: Bytes written (and checksummed) per system call: sized for the core's cache, so each
#: chunk is read from memory once for both.
WRITE_CHUNK = 256 << 10


@dataclass(frozen=True)
class RawExtent:
    """Where one item of a raw checkpoint lives: ``length`` bytes at ``offset`` of the
    folder's file ``relative_path``."""

    relative_path: str
    offset: int
    length: int


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor's elements, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview, digest: Any) -> None:
    for start in range(0, len(data), WRITE_CHUNK):
        chunk = data[start : start + WRITE_CHUNK]
        digest.update(chunk)
        while chunk:
            chunk = chunk[os.write(fd, chunk) :]


class RawWriter(StorageWriter):
    """Writes a DCP checkpoint of raw bytes into the existing private folder ``folder``.

    After ``dcp.save``: :attr:`files` holds the checksum record (``checksum``, one of
    :data:`fsdp_interactive.checkpoint._format._checksums.CHECKSUMS`) of each file this rank wrote,
    the coordinator's ``.metadata`` included, and :attr:`metadata_bytes` the metadata file's content
    on the coordinator. ``sync``: each file is fsynced (a no-op in host memory, durable on disk).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        checksum: str = _manifest.SNAPSHOT_CHECKSUM,
        sync: bool = True,
    ) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.checksum = checksum
        self.sync = sync
        self.files: dict[str, _manifest.FileRecord] = {}
        self.metadata_bytes: bytes | None = None
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.folder = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def _new_file(self, name: str) -> int:
        folder = _private_files.open_folder(self.folder)
        try:
            return _private_files.create_file(name, folder_fd=folder)
        finally:
            os.close(folder)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data}0.distcp"
        digest = new_checksum(self.checksum)
        results, offset = [], 0
        fd = self._new_file(name)
        try:
            # Non-tensor items first (small), then the tensors, in the plan's order.
            items = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
            for item in items:
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):
                    view = data.getbuffer()
                else:
                    tensor = data.detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    view = tensor_bytes(tensor.contiguous())
                _write_all(fd, view, digest)
                results.append(
                    WriteResult(item.index, len(view), RawExtent(name, offset, len(view)))
                )
                offset += len(view)
            if self.sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self.files[name] = _manifest.FileRecord(offset, digest.hexdigest(), self.checksum)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for per_rank in results for r in per_rank}
        metadata.storage_meta = self.storage_meta()
        data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        digest = new_checksum(self.checksum)
        fd = self._new_file(METADATA_FILE)
        try:
            _write_all(fd, memoryview(data), digest)
            if self.sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self.metadata_bytes = data
        self.files[METADATA_FILE] = _manifest.FileRecord(
            len(data), digest.hexdigest(), self.checksum
        )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.folder), save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
