"""Converting between a checkpoint folder and a plain (unsharded) state-dict file.

Both directions run in one process without a process group (DCP's ``no_dist`` mode),
also in a process that has one:

* :func:`to_full` reads the model part of a checkpoint (any saved world size) into full
  CPU tensors and writes them as ``.safetensors`` or as a ``torch.save`` file that loads
  with ``torch.load(..., weights_only=True)``. Optimizer and Stateful state are not
  exported.
* :func:`from_full` turns such a file (or a plain ``nn.Module`` state dict) into a
  published checkpoint with world size 1 and no optimizer state, through the same save
  pipeline as :func:`save`; :func:`load` reshards it onto any number of ranks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _checkpoint_folders, _pipeline
from fsdp_interactive.checkpoint._format._safe_reader import safe_load, section_paths
from fsdp_interactive.checkpoint._load import check_folder, unwrap_dcp_error, verify_files
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


def read_full_model_state(
    checkpoint: str | os.PathLike, *, trusted: bool = False
) -> dict[str, torch.Tensor]:
    """The model part of a checkpoint as full CPU tensors (checksums verified first; a
    checkpoint that is not this user's is refused as :func:`~._load.load` refuses it,
    unless ``trusted``)."""
    folder = Path(checkpoint).absolute()
    manifest, metadata, _ = check_folder(folder, trusted=trusted)
    verify_files(folder, manifest, metadata, Ranks(local=True), checksum=True)
    target: dict[str, Any] = {"model": {}}
    for key, path in section_paths(metadata, "model").items():
        entry = metadata.state_dict_metadata[key]
        if isinstance(entry, TensorStorageMetadata) and len(path) == 2:
            target["model"][path[1]] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    try:
        safe_load(target, folder, metadata=metadata)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        raise unwrap_dcp_error(exc) from exc
    return target["model"]


def to_full(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str | None = None,
    trusted: bool = False,
) -> ConversionResult:
    """Write the checkpoint's model state as one plain state-dict file ``out``.

    Only this user's checkpoints are read, as :func:`~fsdp_interactive.checkpoint.load`
    reads them (``trusted=True``: a checkpoint the caller knows to be sound).

    ``format``: ``"safetensors"`` or ``"torch"``; by default chosen from ``out``'s suffix
    (``.safetensors`` -> safetensors, anything else -> ``torch.save``).
    """
    out_path = Path(out)
    fmt = _format_for(out_path, format)
    if out_path.is_dir():
        raise CheckpointPathError(f"output {str(out_path)!r} is a folder; expected a file path")
    state = read_full_model_state(checkpoint, trusted=trusted)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.partial-{_checkpoint_folders.new_token()}")
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
    started = time.monotonic()
    state = read_state_file(source) if not isinstance(source, dict) else dict(source)
    request = _pipeline.SaveRequest.of(
        checkpoint, step=step, keep_last=None, overwrite=overwrite, extra=None
    )
    captured = _pipeline.Capture(
        {"model": {k: v.detach().cpu() for k, v in state.items()}},
        _pipeline.Contents(has_optimizer=False),
    )
    ranks = Ranks(local=True)
    plan = _pipeline.plan(request, "sync", ranks, started=started)
    result = _pipeline.run(plan, captured, ranks).wait()
    return ConversionResult(
        source=str(source) if not isinstance(source, dict) else "<state dict>",
        output=result.path,
        num_tensors=len(state),
        size_bytes=result.size_bytes,
        format="dcp",
    )
