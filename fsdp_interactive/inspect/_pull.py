"""``plain_copy``: make a rank-side value safe to send to the notebook kernel (rank side)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._plain import cpu_copy, tensors_in
from fsdp_interactive._torch_compat import ShardedTensor, is_fsdp1_managed
from fsdp_interactive.fsdp._comm_device import gather_full
from fsdp_interactive.wrapping import model_params

TOO_LARGE = "value too large to pull"


def _tensor_bytes(value: torch.Tensor) -> int:
    return math.prod(value.shape) * value.element_size()


def _gather_to_cpu(value: DTensor) -> torch.Tensor:
    return gather_full(value, to_cpu=True)


def _refuse_pieces(value: Any, name: str) -> None:
    """``TypeError`` for a tensor whose whole this rank cannot gather from the tensor alone:
    a piece of torch FSDP1's flat parameter (its bookkeeping lives in the model) or a
    ``ShardedTensor``."""
    for where, tensor in tensors_in(value, name):
        if is_fsdp1_managed(tensor):
            raise TypeError(
                f"{where} is held by torch FSDP1, flattened into a flat parameter: this rank "
                "holds a piece of it. Pull the whole parameter with "
                "fsdp_interactive.inspect.full_param(model, 'its.name'), or pull it inside "
                "FullyShardedDataParallel.summon_full_params(model)"
            )
        if isinstance(tensor, ShardedTensor):
            raise TypeError(
                f"{where} is a ShardedTensor (torch FSDP1's sharded state dict): this rank "
                "holds shards of it. Pull a full state dict instead (StateDictType."
                "FULL_STATE_DICT, or torch.distributed.checkpoint.state_dict."
                "get_model_state_dict with StateDictOptions(full_state_dict=True))"
            )


def full_param(model: nn.Module, fqn: str, max_bytes: int | None = 256 * 2**20) -> torch.Tensor:
    """The whole parameter ``fqn`` of ``model`` (clean or wrapped name), as a plain CPU
    tensor, however the model is wrapped (:func:`fsdp_interactive.wrapping.model_params`).

    A collective over the groups that split the parameter: every rank of them calls it.
    ``ValueError`` above ``max_bytes`` (before any communication, on every rank alike;
    ``None``: no limit), ``KeyError`` for an unknown name, ``ValueError`` for a module's.
    """
    params = model_params(model)
    if not params.is_parameter(fqn):
        params.select(fqn)  # KeyError for a name that is neither
        raise ValueError(f"full_param reads one parameter; {fqn!r} is a module")
    param = params[params.resolve(fqn)]
    nbytes = param.numel * param.element_size
    if max_bytes is not None and nbytes > max_bytes:
        raise ValueError(
            f"{TOO_LARGE}: {param.fqn} is {nbytes} bytes unsharded (shape {param.shape}, "
            f"{param.dtype}), above the limit of {max_bytes} bytes"
        )
    return param.full_tensor(to_cpu=True)


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
    parameter or a state dict instead), meta tensors with ``ValueError``, and with
    ``TypeError`` what this rank cannot make whole from the tensor alone: a piece of torch
    FSDP1's flat parameter (:func:`full_param` reads one through the model) and a
    ``ShardedTensor``. Other values come back unchanged.
    """
    if isinstance(value, nn.Module):
        raise TypeError(
            f"{name} is a module ({type(value).__name__}); pull one of its parameters or its "
            "state_dict() instead"
        )
    _refuse_pieces(value, name)
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
