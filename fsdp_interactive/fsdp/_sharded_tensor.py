"""torch's ``ShardedTensor`` (FSDP1's sharded values) as input: turned into this package's
``DTensor`` layout.

torch FSDP1 hands out ``ShardedTensor`` values, and so does torch's documented loader of
sharded optimizer state (``torch.distributed.checkpoint.optimizer.
load_sharded_optimizer_state_dict``, which chunks every tensor on dim 0 over the world).
Wherever FSDP1 accepts them (``load_state_dict`` under ``SHARDED_STATE_DICT``,
``optim_state_dict_to_load``), this package accepts them too, through
:func:`to_dtensor_like`:

* when every rank's local shard is exactly the piece that rank holds of the target
  parameter (the usual case: both are ``torch.chunk`` pieces on dim 0 over the same ranks),
  the local shard is wrapped as is (no copy, no communication beyond one flag);
* otherwise (another world size's chunking, an HSDP or sub-group mesh, several shards per
  rank) the full tensor is assembled on every rank of the ``ShardedTensor``'s group (one
  all-reduce of the full size) and each rank keeps its own piece.

The decision is made jointly (one all-reduce of a flag over the ``ShardedTensor``'s
group), so every rank of that group must convert the same values in the same order, as
every rank does in FSDP1's load calls. Both all-reduces run on the group's communication device
(:func:`~._comm_device.comm_device`), wherever the shards are kept: CPU shards over an
NCCL-only group are sent from the GPU. Not done: ``ShardedTensor`` values nested inside
others (2-D tensor parallel), which FSDP1's own loaders reject too.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import (
    ShardedTensor,
    local_shape_and_offset,
    sharded_tensor_group,
)
from fsdp_interactive.fsdp._comm_device import comm_device

logger = logging.getLogger(__name__)


def is_sharded_tensor(value: object) -> bool:
    """Whether ``value`` is torch's ``ShardedTensor``."""
    return isinstance(value, ShardedTensor)


def to_dtensor_like(value: ShardedTensor, like: DTensor) -> DTensor:
    """``value``'s data as a ``DTensor`` on ``like``'s mesh and placements (a collective over
    ``value``'s group; see the module docstring). Keeps ``value``'s dtype.

    ``ValueError`` if the global shapes differ.
    """
    if tuple(value.size()) != tuple(like.shape):
        raise ValueError(
            f"ShardedTensor of global shape {tuple(value.size())} cannot be loaded into a "
            f"parameter of shape {tuple(like.shape)}"
        )
    group = sharded_tensor_group(value)
    shape, offset = local_shape_and_offset(like.shape, like.device_mesh, like.placements)
    own = _own_piece(value, shape, offset)
    everywhere = torch.tensor(
        [1 if own is not None else 0], dtype=torch.int32, device=comm_device(group)
    )
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group)
    if bool(everywhere.item()):
        assert own is not None
        local = own
    else:
        logger.debug(
            "ShardedTensor of shape %s: shards differ from the parameter's layout; "
            "assembling the full tensor to reshard",
            tuple(value.size()),
        )
        full = _assemble(value, like, group)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        local = full[index].clone()
    return local_as_dtensor_like(local, like)


def local_as_dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` (this rank's piece, unchecked) as a DTensor with ``like``'s mesh, placements,
    global shape and stride, on ``like``'s device; no communication."""
    return DTensor.from_local(
        local.to(like.device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def piece_as_dtensor_like(
    full: torch.Tensor, like: DTensor, dtype: torch.dtype | None = None
) -> DTensor:
    """This rank's piece of the full tensor ``full``, as a DTensor like ``like`` (see
    :func:`local_as_dtensor_like`), copied onto ``like``'s device (in ``dtype`` if given,
    else ``full``'s): never a view of ``full``, so ``full`` can be freed at once. Only the
    piece is copied. No communication."""
    shape, offset = local_shape_and_offset(like.shape, like.device_mesh, like.placements)
    piece = full
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        piece = piece.narrow(dim, start, size)
    return local_as_dtensor_like(piece.to(like.device, dtype or piece.dtype, copy=True), like)


def _own_piece(
    value: ShardedTensor, shape: tuple[int, ...], offset: tuple[int, ...]
) -> torch.Tensor | None:
    """This rank's local shard if it is exactly the piece (``shape`` at ``offset``), an
    empty tensor if both are empty, else ``None``."""
    shards = [s for s in value.local_shards() if s.tensor.numel() > 0]
    if not shards:
        empty = 0 in shape
        return torch.empty(shape, dtype=value.dtype) if empty else None
    if len(shards) != 1:
        return None
    meta = shards[0].metadata
    if tuple(meta.shard_offsets) == tuple(offset) and tuple(meta.shard_sizes) == tuple(shape):
        return shards[0].tensor
    return None


def _assemble(value: ShardedTensor, like: DTensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor on every rank of ``group``: each rank writes its shards into zeros,
    a sum adds the (disjoint) pieces, which is exact. On ``group``'s communication device:
    the shards' own device says nothing about what the group can send (FSDP1's shards of a
    CUDA model may have been offloaded to CPU, over an NCCL-only group)."""
    device = comm_device(group)
    full = torch.zeros(tuple(value.size()), dtype=value.dtype, device=device)
    for shard in value.local_shards():
        index = tuple(
            slice(o, o + s)
            for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
        )
        full[index] = shard.tensor.to(device)
    dist.all_reduce(full, group=group)
    return full
