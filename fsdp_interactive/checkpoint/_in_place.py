"""Which of a model's own tensors a load may read into directly, instead of into fresh
buffers that are then copied into the model.

A restore from host memory is bounded by copies: reading a shard into a new buffer and
copying the buffer into the parameter doubles the work for the model's part, and the new
buffer's pages are first touched (zeroed by the kernel) on the way. A value of the
model's state dict that *is* the storage of one of the model's parameters or buffers
(``fully_shard``'s local shards, a plain module's parameters) can be read into as it is.
Anything else (a value that is not a tensor, a tensor the state dict made as a copy, as
torch's FSDP1 with flat parameters does) keeps a buffer. Nothing here reads or writes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def owned_storages(model: nn.Module) -> set[int]:
    """The storages (by address) of ``model``'s parameters and buffers (their local shards)."""
    return {
        _local(t).untyped_storage().data_ptr()
        for t in [*model.parameters(), *model.buffers()]
        if _local(t).numel()
    }


def is_own(value: Any, owned: set[int]) -> bool:
    """Whether the state-dict value ``value`` is (a view of) one of the storages ``owned``,
    so that reading into it writes the model's own tensor."""
    if not isinstance(value, torch.Tensor):
        return False
    local = _local(value)
    return local.numel() == 0 or local.untyped_storage().data_ptr() in owned
