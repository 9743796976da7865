"""Reading DCP checkpoints without unpickling arbitrary objects.

``torch.distributed.checkpoint`` stores two kinds of pickled data:

* the ``.metadata`` file, read by ``FileSystemReader.read_metadata`` with a plain
  ``pickle.load`` (any class, any callable: loading an untrusted checkpoint can run code);
* non-tensor values (``BytesStorageMetadata`` items such as an optimizer's ``lr``),
  read by ``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=False)``.

This module closes both doors:

* :func:`read_metadata` unpickles ``.metadata`` with an allow-list unpickler that
  resolves only the DCP metadata dataclasses, ``torch.Size``, torch dtypes, the layout and
  memory-format decoders DCP itself pickles, and path objects; anything else raises
  :class:`~fsdp_interactive.checkpoint.errors.CorruptCheckpointError`. The result is then
  validated (types, file names confined to the checkpoint folder, non-negative extents).
* :class:`SafeLoadPlanner` reads byte items with ``torch.load(weights_only=True)``
  (plain Python containers and numbers only).

Not done here: checksums (see :mod:`._manifest`), and resharding logic (DCP's).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from fsdp_interactive._torch_compat import DCP_METADATA_PRIVATE_GLOBALS, set_element
from fsdp_interactive.checkpoint._single_process import single_process_quietly
from fsdp_interactive.checkpoint.errors import CorruptCheckpointError

METADATA_FILE = ".metadata"

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}


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
    return _ALLOWED_GLOBALS


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP's metadata is made of."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_globals().get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def read_metadata(checkpoint_dir: str | os.PathLike) -> Metadata:
    """Load and validate ``<checkpoint_dir>/.metadata`` without arbitrary unpickling.

    Raises :class:`CorruptCheckpointError` naming the file when it is missing, truncated,
    refers to disallowed globals, or describes storage outside the checkpoint folder.
    """
    path = Path(checkpoint_dir) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
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


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata`.

    Data-file read failures are re-raised as :class:`CorruptCheckpointError` naming the
    file.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CorruptCheckpointError(
                f"{self.path}: per-rank metadata files are not supported", file=str(self.path)
            )
        metadata = read_metadata(self.path)
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


def safe_load(state: dict[str, Any], folder: str | os.PathLike, no_dist: bool) -> None:
    """``dcp.load`` into ``state`` from ``folder`` through :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner` (no arbitrary unpickling); DCP's errors propagate unchanged."""
    with single_process_quietly():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=SafeLoadPlanner(),
            no_dist=no_dist,
        )
