"""``plain_copy``: make a rank-side value safe to send to the notebook kernel (rank side)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

TOO_LARGE = "value too large to pull"


def _tensor_bytes(value: torch.Tensor) -> int:
    return math.prod(value.shape) * value.element_size()


def _total_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return _tensor_bytes(value)
    if isinstance(value, dict):
        return sum(_total_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_total_bytes(v) for v in value)
    return 0


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):
            value = value.full_tensor()
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _copy(v)) for k, v in value.items())
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_copy(v) for v in value)
    return value


def plain_copy(value: Any, max_bytes: int | None = 256 * 2**20, name: str = "value") -> Any:
    """A copy of ``value`` that the notebook kernel can receive.

    Tensors (DTensor or FSDP parameters included), also inside dicts, lists and tuples
    (e.g. a state dict), become plain, detached CPU tensors; a DTensor is gathered with
    ``full_tensor()``, a collective over its mesh, so every rank of the mesh must call this.
    If the tensors' full size exceeds ``max_bytes``, ``ValueError`` is raised before any
    communication, identically on every rank (``max_bytes=None``: no limit).  Modules are
    refused (pull a parameter or a state dict instead).  Other values come back unchanged.
    """
    if isinstance(value, nn.Module):
        raise TypeError(
            f"{name} is a module ({type(value).__name__}); pull one of its parameters or its "
            "state_dict() instead"
        )
    nbytes = _total_bytes(value)
    if max_bytes is not None and nbytes > max_bytes:
        shape = (
            f" (shape {tuple(value.shape)}, {value.dtype})"
            if isinstance(value, torch.Tensor)
            else ""
        )
        raise ValueError(
            f"{TOO_LARGE}: {name} is {nbytes} bytes unsharded{shape}, above the limit of "
            f"{max_bytes} bytes"
        )
    return _copy(value)
