"""``plain_copy``: make a rank-side value safe to send to the notebook kernel (rank side)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

TOO_LARGE = "value too large to pull"


def plain_copy(value: Any, max_bytes: int | None = 256 * 2**20, name: str = "value") -> Any:
    """A copy of ``value`` that the notebook kernel can receive.

    Tensors (DTensor or FSDP parameters included) become plain, detached CPU tensors; a
    DTensor is gathered with ``full_tensor()``, which is a collective over its mesh, so
    every rank of the mesh must call this.  Tensors whose full size exceeds ``max_bytes``
    raise ``ValueError`` (before any communication, identically on every rank) unless
    ``max_bytes`` is None.  Other values are returned unchanged.
    """
    if not isinstance(value, torch.Tensor):
        return value
    nbytes = math.prod(value.shape) * value.element_size()
    if max_bytes is not None and nbytes > max_bytes:
        raise ValueError(
            f"{TOO_LARGE}: {name} is {nbytes} bytes unsharded "
            f"(shape {tuple(value.shape)}, {value.dtype}), above the limit of {max_bytes} bytes"
        )
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().to("cpu", copy=True)
