"""``plain_copy``: make a rank-side value safe to send to the notebook kernel (rank side)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._plain import cpu_copy, tensors_in
from fsdp_interactive.fsdp._comm_device import gather_full

TOO_LARGE = "value too large to pull"


def _tensor_bytes(value: torch.Tensor) -> int:
    return math.prod(value.shape) * value.element_size()


def _gather_to_cpu(value: DTensor) -> torch.Tensor:
    return gather_full(value, to_cpu=True)


def plain_copy(value: Any, max_bytes: int | None = 256 * 2**20, name: str = "value") -> Any:
    """A copy of ``value`` that the notebook kernel can receive.

    Every tensor, also inside lists, tuples, namedtuples, dicts, dataclasses, sets and
    frozensets (e.g. a state dict or a record), becomes a plain, detached CPU tensor
    (:func:`fsdp_interactive._plain.cpu_copy`, whose contract says what is not looked
    into). A DTensor (an FSDP parameter) is gathered whole, one at a time on its mesh's
    communication device and moved to the CPU before the next (a collective over its mesh:
    every rank of the mesh must call this with the same structure; a DTensor inside a set
    is refused with ``TypeError``). If the tensors' full size exceeds ``max_bytes``,
    ``ValueError`` is raised before any communication, identically on every rank
    (``max_bytes=None``: no limit). Modules are refused with ``TypeError`` (pull a
    parameter or a state dict instead), meta tensors with ``ValueError``. Other values
    come back unchanged.
    """
    if isinstance(value, nn.Module):
        raise TypeError(
            f"{name} is a module ({type(value).__name__}); pull one of its parameters or its "
            "state_dict() instead"
        )
    nbytes = sum(_tensor_bytes(t) for _, t in tensors_in(value, name))
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
    return cpu_copy(value, dtensor=_gather_to_cpu, name=name)
