"""Rank 0's nested state on every rank, one tensor at a time.

:func:`broadcast_from_rank0` sends a state (dicts, lists and tuples with tensors anywhere
inside, e.g. a full optimizer state dict) from rank 0 of a group to its other ranks the
way torch FSDP1's ``optim_state_dict_to_load(rank0_only=True)`` does
(``torch/distributed/fsdp/_optim_utils.py``, ``_broadcast_processed_state`` then
``_broadcast_state``): first the structure, with every tensor replaced by its shape and
dtype, as one small object; then each tensor on its own, on the group's communication
device (:func:`~._comm_device.comm_device`), in the structure's order. Each received
tensor is handed to ``receive(path, tensor)`` at once, and what it returns takes the
tensor's place, so the device never holds more than the tensor in flight as long as
``receive`` keeps no reference to it (it may keep a CPU copy, or this rank's shard).

Pickling the whole state into one ``broadcast_object_list`` instead would put the whole
of it on the device (NCCL) at once, pickled, and in CPU memory twice.

Not done: a DTensor in rank 0's state is refused (gather it first); containers other than
dicts, lists and tuples (namedtuples included) are not looked into, and they and every
other object travel inside the structure as they are (pickled), so they should be small.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.fsdp._comm_device import CPU, comm_device

logger = logging.getLogger(__name__)

Path = tuple[Any, ...]
Receive = Callable[[Path, torch.Tensor], Any]


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor sits in the structure sent first: what the receivers allocate."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _to_cpu(_path: Path, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(CPU, copy=True)


def broadcast_from_rank0(
    obj: Any, *, group: dist.ProcessGroup | None = None, receive: Receive = _to_cpu
) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (``None``: the default group).

    Every rank of ``group`` calls this; only rank 0's ``obj`` is read. Tensors are replaced
    by ``receive(path, tensor)`` on every rank, rank 0 included (``path``: the keys and
    indices leading to the tensor); by default a CPU copy. Without a process group (or in a
    group of one) nothing is sent and ``receive`` is still applied. ``TypeError`` on rank 0
    (before anything is sent, so ranks blocked in the next collective are not left
    waiting: every rank raises it) for a DTensor inside ``obj``.
    """
    ranks = Ranks(group)
    sender = ranks.rank == 0
    problem = _find_dtensor(obj, ()) if sender else None
    skeleton = ranks.from_rank0((problem, _skeleton(obj) if sender and problem is None else None))
    problem, structure = skeleton
    if problem is not None:
        raise TypeError(
            f"broadcast_from_rank0: {problem} is a DTensor; gather it to a full tensor first"
        )
    device = comm_device(group)
    src = dist.get_global_rank(group, 0) if ranks.distributed and group is not None else 0
    sent = [0]

    def transfer(path: Path, slot: _TensorSlot, value: Any) -> Any:
        if sender:
            buffer = value.detach().to(device).contiguous()  # collectives take dense tensors
        else:
            buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        if ranks.distributed and ranks.size > 1:
            dist.broadcast(buffer, src=src, group=group)
        sent[0] += buffer.numel() * buffer.element_size()
        return receive(path, buffer)

    result = _fill(structure, obj if sender else None, (), transfer)
    logger.debug("broadcast %d bytes of tensors from rank 0 on %s", sent[0], device)
    return result


def _find_dtensor(obj: Any, path: Path) -> str | None:
    if isinstance(obj, DTensor):
        return _describe(path)
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = _find_dtensor(value, (*path, key))
        if found is not None:
            return found
    return None


def _describe(path: Path) -> str:
    return "the state" + "".join(f"[{key!r}]" for key in path)


def _skeleton(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _TensorSlot(tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {key: _skeleton(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_skeleton(value) for value in obj]
    if isinstance(obj, tuple):
        return _same_tuple(obj, [_skeleton(value) for value in obj])
    return obj


def _same_tuple(like: tuple, values: list[Any]) -> tuple:
    """``values`` as a tuple of ``like``'s type (a namedtuple stays one)."""
    return type(like)(*values) if hasattr(like, "_fields") else tuple(values)


def _fill(
    structure: Any,
    original: Any,
    path: Path,
    transfer: Callable[[Path, _TensorSlot, Any], Any],
) -> Any:
    """``structure`` with each slot replaced by ``transfer`` (one at a time, in order);
    ``original`` is rank 0's matching value (``None`` elsewhere)."""
    if isinstance(structure, _TensorSlot):
        return transfer(path, structure, original)
    if isinstance(structure, dict):
        return {
            key: _fill(value, None if original is None else original[key], (*path, key), transfer)
            for key, value in structure.items()
        }
    if isinstance(structure, list | tuple):
        filled = [
            _fill(value, None if original is None else original[i], (*path, i), transfer)
            for i, value in enumerate(structure)
        ]
        return filled if isinstance(structure, list) else _same_tuple(structure, filled)
    return structure
