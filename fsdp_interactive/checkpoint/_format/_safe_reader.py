"""Reading DCP checkpoints without unpickling arbitrary objects.

``torch.distributed.checkpoint`` stores two kinds of pickled data:

* the ``.metadata`` file, read by ``FileSystemReader.read_metadata`` with a plain
  ``pickle.load`` (any class, any callable: loading an untrusted checkpoint can run code);
* non-tensor values (``BytesStorageMetadata`` items such as an optimizer's ``lr``),
  read by ``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=False)``.

This module closes both doors:

* :func:`read_metadata` unpickles ``.metadata`` with an allow-list unpickler that
  resolves only the DCP metadata dataclasses, ``torch.Size``, torch dtypes, the layout and
  memory-format decoders DCP itself pickles, path objects and the raw format's
  :class:`~._raw_storage.RawExtent`; and ``builtins.getattr`` only as CPython's own enum
  pickling uses it (some 3.11 releases, Debian 12's 3.11.2 among them, pickle an enum
  member as ``getattr(EnumClass, "NAME")``): with an allowed enum class and the name of
  one of its members, nothing else. Anything else raises
  :class:`~fsdp_interactive.checkpoint.errors.CorruptCheckpointError`. The result is then
  validated (types, file names confined to the checkpoint folder, non-negative extents).
* :class:`SafeLoadPlanner` reads byte items with ``torch.load(weights_only=True)``
  (plain Python containers and numbers only).

:func:`safe_load` reads both storage formats: DCP's own (``torch.save`` per item, through
:class:`SafeFileSystemReader`) and the raw one snapshots write (:class:`RawReader`, which
reads each chunk straight into its target where their layouts match). Not done here:
checksums (see :mod:`._manifest`), and resharding logic (DCP's).
"""

from __future__ import annotations

import enum
import io
import math
import os
import pickle
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fsdp_interactive import _private_files
from fsdp_interactive._torch_compat import DCP_METADATA_PRIVATE_GLOBALS, set_element
from fsdp_interactive.checkpoint._format._raw_storage import METADATA_FILE, RawExtent
from fsdp_interactive.checkpoint._single_process import single_process_quietly
from fsdp_interactive.checkpoint.errors import CorruptCheckpointError

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}
#: The module :class:`RawExtent` was pickled from before the format's modules had a folder.
_EARLIER_RAW_STORAGE = "fsdp_interactive.checkpoint._raw_storage"


def _allowed_globals() -> dict[tuple[str, str], Any]:
    if not _ALLOWED_GLOBALS:
        import pathlib

        import torch.distributed.checkpoint.metadata as dcp_md

        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        ):
            if hasattr(dcp_md, name):
                _ALLOWED_GLOBALS[(_DCP_METADATA_MODULE, name)] = getattr(dcp_md, name)
        _ALLOWED_GLOBALS.update(DCP_METADATA_PRIVATE_GLOBALS)
        _ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
            _ALLOWED_GLOBALS[("pathlib", name)] = getattr(pathlib, name)
        _ALLOWED_GLOBALS[("collections", "OrderedDict")] = __import__("collections").OrderedDict
        _ALLOWED_GLOBALS[(RawExtent.__module__, RawExtent.__name__)] = RawExtent
        # Where snapshots persisted by earlier releases name it (the module moved here).
        _ALLOWED_GLOBALS[(_EARLIER_RAW_STORAGE, RawExtent.__name__)] = RawExtent
    return _ALLOWED_GLOBALS


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """``getattr(cls, name)`` as CPython's enum pickling calls it, for an allowed enum class
    and the name of one of its members only."""
    allowed = {
        value
        for value in _allowed_globals().values()
        if isinstance(value, type) and issubclass(value, enum.Enum)
    }
    if cls not in allowed:
        raise pickle.UnpicklingError(
            f"refusing getattr({cls!r}, {name!r}): getattr is allowed on the metadata's "
            "enum classes only"
        )
    if not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(
            f"refusing getattr({cls.__name__}, {name!r}): not the name of one of its members"
        )
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP's metadata is made of (and enum members by name)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_globals().get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


#: The most a ``.metadata`` file whose size no manifest gives may hold.
METADATA_LIMIT = 1 << 30


def read_metadata(checkpoint_dir: str | os.PathLike, *, limit: int | None = None) -> Metadata:
    """Load and validate ``<checkpoint_dir>/.metadata`` without arbitrary unpickling.

    The file is read as :func:`fsdp_interactive._private_files.read_regular` reads (no
    link followed, no wait on a FIFO), at most ``limit`` bytes (its size in the manifest;
    ``None``: :data:`METADATA_LIMIT`). Raises :class:`CorruptCheckpointError` naming the
    file when it is missing, larger, truncated, refers to disallowed globals, or
    describes storage outside the checkpoint folder.
    """
    path = Path(checkpoint_dir) / METADATA_FILE
    bound = METADATA_LIMIT if limit is None else limit
    try:
        data = _private_files.read_regular(path, limit=bound)
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path}: the DCP metadata file is missing (not a checkpoint, or an unfinished save)",
            file=str(path),
        ) from None
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{path}: cannot read DCP metadata ({type(exc).__name__}: {exc})", file=str(path)
        ) from exc
    _validate_metadata(metadata, path)
    return metadata


def _validate_metadata(metadata: Any, path: Path) -> None:
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: invalid DCP metadata: {why}", file=str(path))

    if not isinstance(metadata, Metadata):
        raise bad(f"top-level object is {type(metadata).__name__}, expected Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a dict")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a string")
        if not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
            raise bad(f"entry {key!r} has type {type(item).__name__}")
        if isinstance(item, TensorStorageMetadata) and not isinstance(item.size, torch.Size):
            raise bad(f"entry {key!r} has no valid size")
    if not isinstance(metadata.storage_data, dict):
        raise bad("storage_data is not a dict")
    for info in metadata.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or PurePath(rel).name != rel or rel in {".", ".."}:
            raise bad(f"storage file name {rel!r} is not a plain file name in the folder")
        for field in ("offset", "length"):
            value = getattr(info, field, None)
            if not isinstance(value, int) or value < 0:
                raise bad(f"storage extent {field}={value!r} for {rel!r}")


def section_paths(metadata: Metadata, section: str) -> dict[str, tuple]:
    """Flattened DCP key -> object path (a tuple of keys) of the entries under ``section``
    (the top-level key of the saved state dict: "model", "optim", ...)."""
    mapping = getattr(metadata, "planner_data", None) or {}
    out = {}
    for key in metadata.state_dict_metadata:
        path = mapping.get(key)
        if path is None:
            head, _, rest = key.partition(".")
            path = (head, rest)
        if path and path[0] == section:
            out[key] = tuple(path)
    return out


def storage_extents(metadata: Metadata) -> dict[str, int]:
    """Map each data file named by ``metadata`` to the number of bytes it must hold."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    return need


class _RegularFilesOnly(FileSystem):
    """DCP's local file system, whose streams for reading open only regular files, without
    following a link or waiting on a FIFO (:func:`_private_files.open_regular`)."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with os.fdopen(_private_files.open_regular(path), "rb") as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata`, and whose data
    files are opened as regular files only (:class:`_RegularFilesOnly`).

    Data-file read failures are re-raised as :class:`CorruptCheckpointError` naming the
    file. ``metadata``: the folder's, read already by :func:`read_metadata` (``None``:
    read when DCP asks).
    """

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self.fs = _RegularFilesOnly()
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CorruptCheckpointError(
                f"{self.path}: per-rank metadata files are not supported", file=str(self.path)
            )
        metadata = self._metadata if self._metadata is not None else read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):  # type: ignore[override]
        files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        try:
            return super().read_data(plan, planner)
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            names = ", ".join(str(Path(self.path) / f) for f in files)
            raise CorruptCheckpointError(
                f"cannot read checkpoint data from {names} ({type(exc).__name__}: {exc})",
                file=str(Path(self.path) / files[0]) if len(files) == 1 else names,
            ) from exc


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor items with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CorruptCheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} is not plain data "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def is_raw(metadata: Metadata) -> bool:
    """Whether ``metadata`` describes a checkpoint of the raw format (a snapshot's)."""
    return any(isinstance(info, RawExtent) for info in metadata.storage_data.values())


def _read_into(fd: int, tensor: torch.Tensor, offset: int, where: Path) -> None:
    """Fill the contiguous CPU ``tensor`` with the bytes at ``offset`` of ``fd``."""
    if tensor.numel() == 0:
        return
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise CorruptCheckpointError(
                f"{where}: ends before byte {offset + len(view)} (truncated)", file=str(where)
            )
        done += count


class RawReader(StorageReader):
    """Reads a checkpoint of the raw format (:mod:`._raw_storage`) from ``folder``, whose
    validated ``metadata`` (:func:`read_metadata`) is given.

    Each read item is a range of one saved chunk. Where that range is contiguous in the
    file (whole rows of the chunk) and the target is a contiguous CPU tensor of the
    chunk's dtype, the bytes are read straight into the target's memory: one copy, from
    the file's pages. Otherwise the range goes through one buffer that is narrowed and
    copied (another layout, a CUDA target). Files are opened without following a link and
    must be regular files; a file shorter than its extents raises
    :class:`CorruptCheckpointError` naming it.
    """

    def __init__(self, folder: str | os.PathLike, metadata: Metadata) -> None:
        super().__init__()
        self.path = Path(folder)
        self.metadata = metadata
        self.storage_data: dict[Any, Any] = dict(metadata.storage_data)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def _chunk(self, item: ReadItem, extent: RawExtent) -> tuple[torch.dtype, list[int]]:
        """The dtype and sizes of the saved chunk ``item`` reads from (checked against its
        extent's length)."""
        index = item.storage_index
        entry = self.metadata.state_dict_metadata.get(index.fqn)
        chunks = getattr(entry, "chunks", None) or []
        hint = index.index if index.index is not None and index.index < len(chunks) else None
        candidates = ([chunks[hint]] if hint is not None else []) + list(chunks)
        chunk = next((c for c in candidates if list(c.offsets) == list(index.offset or [])), None)
        where = self.path / extent.relative_path
        if chunk is None or not isinstance(entry, TensorStorageMetadata):
            raise CorruptCheckpointError(
                f"{self.path / METADATA_FILE}: no saved chunk of {index.fqn!r} at "
                f"{list(index.offset or [])}",
                file=str(self.path / METADATA_FILE),
            )
        dtype, sizes = entry.properties.dtype, list(chunk.sizes)
        if math.prod(sizes) * dtype.itemsize != extent.length:
            raise CorruptCheckpointError(
                f"{where}: {index.fqn!r} takes {extent.length} bytes, its shape {sizes} and "
                f"{dtype} need {math.prod(sizes) * dtype.itemsize}",
                file=str(where),
            )
        return dtype, sizes

    def _read_tensor(
        self, fd: int, item: ReadItem, extent: RawExtent, planner: LoadPlanner
    ) -> None:
        dtype, sizes = self._chunk(item, extent)
        where = self.path / extent.relative_path
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        target = planner.resolve_tensor(item).detach()
        if list(target.shape) != lengths:
            raise CorruptCheckpointError(
                f"{where}: {item.storage_index.fqn!r} reads {lengths} into a tensor of "
                f"shape {list(target.shape)}",
                file=str(where),
            )
        # Whole rows of the chunk are one contiguous range of the file.
        rows = offsets[1:] == [0] * (len(sizes) - 1) and lengths[1:] == sizes[1:]
        if rows:
            row_bytes = math.prod(sizes[1:]) * dtype.itemsize
            start = extent.offset + (offsets[0] * row_bytes if sizes else 0)
            direct = (
                target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
            )
            buffer = target if direct else torch.empty(lengths, dtype=dtype)
            _read_into(fd, buffer, start, where)
        else:
            buffer = torch.empty(sizes, dtype=dtype)
            _read_into(fd, buffer, extent.offset, where)
            for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
                buffer = buffer.narrow(dim, offset, length)
        if buffer is not target:
            target.copy_(buffer)
        planner.commit_tensor(item, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for name, items in per_file.items():
            where = self.path / name
            try:
                fd = _private_files.open_regular(where)
            except OSError as exc:
                raise CorruptCheckpointError(
                    f"cannot read checkpoint data from {where} ({exc})", file=str(where)
                ) from exc
            try:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    extent = self.storage_data[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO:
                        data = os.pread(fd, extent.length, extent.offset)
                        if len(data) != extent.length:
                            raise CorruptCheckpointError(
                                f"{where}: ends inside {item.storage_index.fqn!r} (truncated)",
                                file=str(where),
                            )
                        planner.load_bytes(item, io.BytesIO(data))
                    else:
                        self._read_tensor(fd, item, extent, planner)
            finally:
                os.close(fd)
        future: Future[None] = Future()
        future.set_result(None)
        return future


def safe_load(
    state: dict[str, Any], folder: str | os.PathLike, metadata: Metadata | None = None
) -> None:
    """``dcp.load`` into ``state`` from ``folder`` through :class:`RawReader` (the raw format)
    or :class:`SafeFileSystemReader` (DCP's own), with :class:`SafeLoadPlanner` (no
    arbitrary unpickling), in this process alone (DCP's ``no_dist``: no collective, so
    ranks of a group agree on errors themselves); DCP's errors propagate unchanged.
    ``metadata``: the folder's, already read by :func:`read_metadata` (``None``: read
    here); it picks the reader, which uses it."""
    if metadata is None:
        metadata = read_metadata(folder)
    reader: StorageReader = (
        RawReader(folder, metadata)
        if is_raw(metadata)
        else SafeFileSystemReader(str(folder), metadata)
    )
    with single_process_quietly():
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
