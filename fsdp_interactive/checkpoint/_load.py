"""Loading a checkpoint into a (possibly differently sharded) model and optimizer.

All-or-nothing: before anything is written into the model or optimizer,

1. the manifest and DCP metadata are read (metadata with the allow-list unpickler);
2. every data file is checked against the manifest's size and SHA-256, the files split
   across the ranks (``verify=False`` checks sizes only);
3. the checkpoint's keys and shapes are compared with the model's (and the optimizer's
   parameter groups);
4. the data are read by DCP into freshly allocated buffers shaped like this rank's
   shards (DCP does the resharding: a checkpoint from N ranks loads on M).

Only then are the buffers applied with ``set_model_state_dict`` /
``set_optimizer_state_dict``. Every rank raises the same error when any check fails.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import set_element
from fsdp_interactive.checkpoint import _manifest, _state
from fsdp_interactive.checkpoint._collective import Ranks
from fsdp_interactive.checkpoint._safe_reader import read_metadata, safe_load
from fsdp_interactive.checkpoint._save import wait_for_pending_save
from fsdp_interactive.checkpoint.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)


@dataclass(frozen=True)
class LoadReport:
    """What a finished load reports (identical on every rank)."""

    path: str
    step: int | None
    saved_world_size: int
    world_size: int
    loaded_optimizer: bool
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _paths_of(metadata: Metadata, section: str) -> dict[str, tuple]:
    """Flattened DCP key -> object path for entries of ``section`` ("model"/"optim")."""
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


def _check_folder(path: Path) -> tuple[_manifest.Manifest, Metadata]:
    if not path.exists():
        raise CheckpointPathError(f"checkpoint path {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointPathError(f"checkpoint path {str(path)!r} is a file; expected a folder")
    manifest = _manifest.read_manifest(path)
    metadata = read_metadata(path)
    return manifest, metadata


def _verify_files(
    path: Path, manifest: _manifest.Manifest, metadata: Metadata, ranks: Ranks, full: bool
) -> None:
    from fsdp_interactive.checkpoint._safe_reader import storage_extents

    problems: list[tuple[str, str]] = []
    for name, need in storage_extents(metadata).items():
        if name not in manifest.files:
            problems.append((str(path / name), f"{path / name}: not listed in the manifest"))
        elif manifest.files[name].size < need:
            problems.append((str(path / name), f"{path / name}: manifest size below data extent"))
    names = sorted(manifest.files)
    for i, name in enumerate(names):
        if not full:
            size_only = _manifest.FileRecord(manifest.files[name].size, "")
            file = path / name
            if not file.exists():
                problems.append((str(file), f"{file}: file is missing"))
            elif file.stat().st_size != size_only.size:
                problems.append(
                    (
                        str(file),
                        f"{file}: file is {file.stat().st_size} bytes, the manifest "
                        f"says {size_only.size} (truncated or altered)",
                    )
                )
            continue
        if i % ranks.size != ranks.rank:
            continue
        message = _manifest.verify_file(path, name, manifest.files[name])
        if message is not None:
            problems.append((str(path / name), message))
    all_problems = sorted({p for per_rank in ranks.all_gather(problems) for p in per_rank})
    if all_problems:
        first_file = all_problems[0][0]
        text = "; ".join(m for _, m in all_problems)
        raise CorruptCheckpointError(f"checkpoint {path} is damaged: {text}", file=first_file)


def _model_targets(
    model: nn.Module, metadata: Metadata, strict: bool
) -> tuple[dict[str, Any], list[str], list[str]]:
    current = _state.model_state(model)
    saved = {
        path[1]: metadata.state_dict_metadata[key]
        for key, path in _paths_of(metadata, "model").items()
        if len(path) == 2
    }
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    shapes = []
    for key in sorted(set(current) & set(saved)):
        entry, value = saved[key], current[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                shapes.append(f"{key}: checkpoint holds a non-tensor value")
            elif tuple(entry.size) != tuple(value.shape):
                shapes.append(
                    f"{key}: checkpoint shape {tuple(entry.size)}, model shape {tuple(value.shape)}"
                )
    if shapes:
        raise IncompatibleCheckpointError(
            "checkpoint does not fit the model: shape mismatch for " + "; ".join(shapes),
            missing_keys=missing,
            unexpected_keys=unexpected,
            shape_mismatches=shapes,
        )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys (in the model, not in the checkpoint): {missing}")
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not in the model): {unexpected}")
        raise IncompatibleCheckpointError(
            "checkpoint does not fit the model (strict=True): "
            + "; ".join(parts)
            + "; pass strict=False to load the common keys",
            missing_keys=missing,
            unexpected_keys=unexpected,
        )
    targets = {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
        for k, v in current.items()
        if k in saved
    }
    return targets, missing, unexpected


def _optim_targets(
    model: nn.Module, metadata: Metadata, strict: bool
) -> tuple[dict[str, Any], list[str]]:
    """Buffers for the saved optimizer state, sharded like the matching parameters."""
    params = {}
    names = _state.param_fqns(model)
    for raw, param in nn.Module.named_parameters(model, remove_duplicate=False):
        params[names[raw]] = param
    target: dict[str, Any] = {}
    unexpected = set()
    for key, path in _paths_of(metadata, "optim").items():
        entry = metadata.state_dict_metadata[key]
        if len(path) >= 3 and path[1] == "state":
            fqn = path[2]
            param = params.get(fqn)
            if param is None:
                unexpected.add(fqn)
                continue
            if isinstance(entry, TensorStorageMetadata):
                dtype = entry.properties.dtype
                if isinstance(param, DTensor) and tuple(entry.size) == tuple(param.shape):
                    value = torch.empty_like(param, dtype=dtype)
                else:
                    value = torch.empty(tuple(entry.size), dtype=dtype)
            else:
                value = None
        else:
            value = None
        set_element(target, path[1:], value)
    if unexpected and strict:
        raise IncompatibleCheckpointError(
            "checkpoint optimizer state names parameters the model does not have: "
            f"{sorted(unexpected)}; pass strict=False to skip them",
            unexpected_keys=sorted(unexpected),
        )
    target.setdefault("state", {})
    target.setdefault("param_groups", [])
    return target, sorted(f"optim:{u}" for u in unexpected)


def _check_param_groups(
    model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]
) -> None:
    expected = _state.optimizer_param_groups(model, optimizer)
    got = [list(g.get("params", [])) for g in loaded.get("param_groups", [])]
    if [sorted(g) for g in got] != [sorted(g) for g in expected]:
        raise IncompatibleCheckpointError(
            "checkpoint optimizer parameter groups do not match the optimizer's: "
            f"checkpoint {got}, optimizer {expected}"
        )


def _unwrap_dcp_error(exc: BaseException) -> BaseException:
    """DCP reports per-rank failures as ``(exception, traceback)`` pairs inside a
    ``CheckpointException`` (a ``BaseException``): surface ours, wrap the others."""
    if isinstance(exc, CheckpointException):
        causes = []
        for failure in exc.failures.values():
            found = failure[0] if isinstance(failure, tuple) else failure
            causes.append(found)
            while found is not None and not isinstance(found, CheckpointError):
                found = found.__cause__
            if isinstance(found, CheckpointError):
                return found
        first = causes[0] if causes else exc
        return CorruptCheckpointError(
            f"reading the checkpoint failed: {type(first).__name__}: {first}"
        )
    return exc


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    verify: bool = True,
) -> LoadReport:
    """Load the checkpoint folder ``path`` into ``model`` (and ``optimizer``); collective.

    Every rank of the default process group calls it. The checkpoint may come from any
    world size. ``strict=True``: any missing/unexpected key raises
    :class:`IncompatibleCheckpointError` listing them; ``strict=False``: the common keys
    are loaded and the rest is reported in the returned :class:`LoadReport`. Shape
    mismatches always raise. ``verify=True`` checks every file's SHA-256 first (split
    across ranks); ``verify=False`` checks sizes only. Nothing is written into the
    model/optimizer unless every check and every read succeeded.
    """
    wait_for_pending_save()
    started = time.monotonic()
    ranks = Ranks()
    folder = Path(path).absolute()
    try:
        manifest, metadata = _check_folder(folder)
        extra = _manifest.read_extra(folder)
        error = None
    except CheckpointError as exc:
        manifest, metadata, extra, error = None, None, {}, exc
    ranks.agree(error)
    assert manifest is not None and metadata is not None
    _verify_files(folder, manifest, metadata, ranks, verify)

    error = None
    try:
        model_target, missing, unexpected = _model_targets(model, metadata, strict)
        target: dict[str, Any] = {"model": model_target}
        if optimizer is not None:
            if not manifest.has_optimizer:
                if strict:
                    raise IncompatibleCheckpointError(
                        f"checkpoint {folder} holds no optimizer state (saved without an "
                        "optimizer); load with optimizer=None or strict=False",
                        missing_keys=["optim"],
                    )
                missing = [*missing, "optim"]
            else:
                optim_target, optim_unexpected = _optim_targets(model, metadata, strict)
                unexpected = [*unexpected, *optim_unexpected]
                target["optim"] = optim_target
    except CheckpointError as exc:
        error = exc
    ranks.agree(error)

    error = None
    try:
        safe_load(target, folder, no_dist=not ranks.distributed)
    except (Exception, CheckpointException) as exc:
        error = _unwrap_dcp_error(exc)
    ranks.agree(error if isinstance(error, CheckpointError) else None)
    if error is not None:
        raise error

    error = None
    if "optim" in target:
        try:
            _check_param_groups(model, optimizer, target["optim"])
        except CheckpointError as exc:
            error = exc
    ranks.agree(error)

    _state.apply_model_state(model, target["model"], strict=False)
    if "optim" in target:
        _state.apply_optimizer_state(model, optimizer, target["optim"])
    return LoadReport(
        path=str(folder),
        step=manifest.step,
        saved_world_size=manifest.world_size,
        world_size=ranks.size,
        loaded_optimizer="optim" in target,
        missing_keys=list(missing),
        unexpected_keys=list(unexpected),
        extra=extra,
        seconds=time.monotonic() - started,
    )
