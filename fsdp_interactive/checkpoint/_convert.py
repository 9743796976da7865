"""Converting between a checkpoint folder and a plain (unsharded) state-dict file.

Both directions run in one process without a process group (DCP's ``no_dist`` mode):

* :func:`to_full` reads the model part of a checkpoint (any saved world size) into full
  CPU tensors and writes them as ``.safetensors`` or as a ``torch.save`` file that loads
  with ``torch.load(..., weights_only=True)``. Optimizer state is not exported.
* :func:`from_full` turns such a file (or a plain ``nn.Module`` state dict) into a
  published checkpoint with world size 1 and no optimizer state; :func:`load` reshards it
  onto any number of ranks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_interactive.checkpoint import _layout, _manifest
from fsdp_interactive.checkpoint._collective import single_process_quietly
from fsdp_interactive.checkpoint._load import _check_folder, _paths_of, _unwrap_dcp_error
from fsdp_interactive.checkpoint._safe_reader import METADATA_FILE, safe_load
from fsdp_interactive.checkpoint.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
)

FileFormat = Literal["safetensors", "torch"]


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote."""

    source: str
    output: str
    num_tensors: int
    size_bytes: int
    format: str


def _format_for(out: Path, fmt: str | None) -> FileFormat:
    if fmt is None:
        fmt = "safetensors" if out.suffix == ".safetensors" else "torch"
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"format must be 'safetensors' or 'torch', got {fmt!r}")
    return fmt  # type: ignore[return-value]


def read_full_model_state(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model part of a checkpoint as full CPU tensors (checksums verified first)."""
    folder = Path(checkpoint).absolute()
    manifest, metadata = _check_folder(folder)
    for name, record in sorted(manifest.files.items()):
        message = _manifest.verify_file(folder, name, record)
        if message is not None:
            raise CorruptCheckpointError(
                f"checkpoint {folder} is damaged: {message}", file=str(folder / name)
            )
    target: dict[str, Any] = {"model": {}}
    for key, path in _paths_of(metadata, "model").items():
        entry = metadata.state_dict_metadata[key]
        if isinstance(entry, TensorStorageMetadata) and len(path) == 2:
            target["model"][path[1]] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    try:
        safe_load(target, folder, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        raise _unwrap_dcp_error(exc) from exc
    return target["model"]


def to_full(
    checkpoint: str | os.PathLike, out: str | os.PathLike, *, format: str | None = None
) -> ConversionResult:
    """Write the checkpoint's model state as one plain state-dict file ``out``.

    ``format``: ``"safetensors"`` or ``"torch"``; by default chosen from ``out``'s suffix
    (``.safetensors`` -> safetensors, anything else -> ``torch.save``).
    """
    out_path = Path(out)
    fmt = _format_for(out_path, format)
    if out_path.is_dir():
        raise CheckpointPathError(f"output {str(out_path)!r} is a folder; expected a file path")
    state = read_full_model_state(checkpoint)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.partial-{_layout.new_token()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        else:
            torch.save(state, tmp)
        os.replace(tmp, out_path)
    except PermissionError as exc:
        raise CheckpointPathError(f"cannot write {str(out_path)!r}: no permission") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return ConversionResult(
        source=str(Path(checkpoint).absolute()),
        output=str(out_path.absolute()),
        num_tensors=len(state),
        size_bytes=out_path.stat().st_size,
        format=fmt,
    )


def read_state_file(source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a plain state-dict file (safetensors, or torch.save with weights_only=True)."""
    src = Path(source)
    if not src.is_file():
        raise CheckpointPathError(f"source {str(src)!r} is not a file")
    try:
        if src.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(src))
        else:
            state = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{src}: not a readable state-dict file ({type(exc).__name__}: {exc})", file=str(src)
        ) from exc
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CorruptCheckpointError(
            f"{src}: expected a mapping of names to tensors", file=str(src)
        )
    return dict(state)


def from_full(
    source: str | os.PathLike | dict[str, torch.Tensor],
    checkpoint: str | os.PathLike,
    *,
    step: int | None = None,
    overwrite: bool = False,
) -> ConversionResult:
    """Write a plain state dict (a file path or a dict) as a checkpoint folder."""
    state = read_state_file(source) if not isinstance(source, dict) else dict(source)
    final = Path(checkpoint).absolute()
    _layout.check_save_target(final, overwrite)
    partial = _layout.partial_path(final, _layout.new_token())
    partial.mkdir()
    try:
        with single_process_quietly():
            dcp.save(
                {"model": {k: v.detach().cpu() for k, v in state.items()}},
                storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True),
                no_dist=True,
            )
        files = {
            p.name: _manifest.hash_file(p)
            for p in sorted(partial.iterdir())
            if p.is_file() and (p.suffix == ".distcp" or p.name == METADATA_FILE)
        }
        now = time.time()
        manifest = _manifest.Manifest(
            step=step,
            world_size=1,
            created_unix=now,
            created_utc=datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
            has_optimizer=False,
            files=files,
        )
        _manifest.write_text_durably(partial / _manifest.EXTRA_FILE, "{}")
        _manifest.write_text_durably(partial / _manifest.MANIFEST_FILE, manifest.to_json())
        _layout.publish(partial, final)
    except BaseException:
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ConversionResult(
        source=str(source) if not isinstance(source, dict) else "<state dict>",
        output=str(final),
        num_tensors=len(state),
        size_bytes=sum(f.size for f in files.values()),
        format="dcp",
    )
