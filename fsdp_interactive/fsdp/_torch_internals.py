"""Every private torch name that :mod:`fsdp_interactive.fsdp` and :mod:`fsdp_interactive.inspect`
use, in one place.

Private names (a leading underscore anywhere in the path) may move or change between torch
releases; keeping them here means a torch upgrade touches one module. Each name says what
it is used for. Attributes of ``fully_shard``'s per-module state (``FSDPState``,
``FSDPParamGroup``, ``FSDPParam``) are read only through the functions below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._shard.sharded_tensor import (
    ShardedTensor as ShardedTensor,  # FSDP1's sharded values, accepted as load input
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    ActivationWrapper as ActivationWrapper,  # activation checkpointing's wrapper class
)
from torch.distributed.algorithms._comm_hooks import (
    default_hooks as default_hooks,  # torch's FSDP1 communication hooks
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._common_utils import _override_module_mixed_precision
from torch.distributed.fsdp._fully_shard._fsdp_api import (
    ReduceScatter as ReduceScatter,  # the interface a custom reduce-scatter implements
)
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.distributed.fsdp._wrap_utils import _warn_on_overridden_mixed_precision
from torch.distributed.fsdp.api import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import (
    _or_policy,
    _Policy,
    _run_mixed_precision_override_policy,
    _wrap_module_cls_individually,
)
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.utils._pytree import tree_map

# The attribute of a checkpoint wrapper holding the wrapped module, so clean names and
# ``FullyShardedDataParallel.module`` see through activation checkpointing.
CHECKPOINT_WRAPPED_MODULE = _CHECKPOINT_WRAPPED_MODULE

# Auto-wrap: torch's policy base class and the helpers FSDP1's auto-wrap uses for
# ``MixedPrecision._module_classes_to_ignore``, so unit selection matches FSDP1 exactly.
Policy = _Policy
or_policy = _or_policy
run_mixed_precision_override_policy = _run_mixed_precision_override_policy
wrap_module_cls_individually = _wrap_module_cls_individually
override_module_mixed_precision = _override_module_mixed_precision
warn_on_overridden_mixed_precision = _warn_on_overridden_mixed_precision

# The zero-2 hybrid strategy: a private member of the public enum, accepted as FSDP1 does.
HYBRID_SHARD_ZERO2 = ShardingStrategy._HYBRID_SHARD_ZERO2

# The suffix nn.Module gives the extra-state entry of a state dict.
EXTRA_STATE_KEY_SUFFIX = nn.modules.module._EXTRA_STATE_KEY_SUFFIX

# Coalescing tensors into one buffer for a single broadcast (sync_module_states).
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors

# Mapping over nested (args, kwargs) structures (casting root forward inputs).
map_tree = tree_map


def run_policy(
    policy: _Policy, root: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict
) -> dict[nn.Module, dict]:
    """The modules ``policy`` wraps under ``root`` with their constructor keywords
    (``_Policy._run_policy``, what FSDP1's auto-wrap calls)."""
    return policy._run_policy(root, ignored_modules, root_kwargs)


def move_own_states(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s own parameters and buffers (not its submodules') to ``device``
    (``nn.Module._apply`` without recursion)."""
    module._apply(lambda t: t.to(device), recurse=False)


def module_classes_without_mixed_precision(mp: MixedPrecision) -> tuple[type, ...]:
    """The module classes FSDP1 keeps in full precision under ``mp`` (batch norm by default)."""
    return tuple(mp._module_classes_to_ignore)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (no autograd), else ``tensor``.

    Reads ``DTensor._local_tensor``: ``to_local()`` goes through an autograd function on
    every call, which dominates a probe over a few hundred parameters.
    """
    if not isinstance(tensor, DTensor):
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return local if local is not None else tensor.to_local()


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of the piece of a ``global_shape`` tensor sharded by
    ``placements`` over ``mesh`` that the rank at ``coordinate`` of the mesh holds.

    ``coordinate=None``: this rank (which must belong to ``mesh``). Shapes are unpadded.
    """
    if coordinate is None:
        shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    else:
        shape, offset = _compute_local_shape_and_global_offset(
            global_shape, tuple(mesh.shape), list(coordinate), placements
        )
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def foreach_norm(
    tensors: list[torch.Tensor], norm_type: float, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """One norm per tensor in a single fused call (``torch._foreach_norm``)."""
    if dtype is None:
        return list(torch._foreach_norm(tensors, norm_type))
    return list(torch._foreach_norm(tensors, norm_type, dtype=dtype))


def sharded_tensor_group(value: ShardedTensor) -> dist.ProcessGroup | None:
    """The process group a ``ShardedTensor`` is sharded over (``ShardedTensor._process_group``;
    checked on torch 2.13.0)."""
    return value._process_group


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place writes the storage this rank holds for ``tensor`` has seen
    (``Tensor._version`` of the local tensor, shared by its views; checked on torch 2.13.0).

    Tells a state-dict placeholder that something (a DCP load) wrote into it from one that
    nothing did.
    """
    return local_tensor(tensor)._version


# ----------------------------------------------------------------------- fully_shard state


def training_state_name(module: FSDPModule) -> str:
    """``fully_shard``'s training state of ``module``: ``"IDLE"``, ``"FORWARD"``, ..."""
    return module._get_fsdp_state()._training_state.name


def has_sharded_params(module: FSDPModule) -> bool:
    """Whether ``fully_shard`` manages any parameter of ``module`` (it has a parameter group)."""
    return bool(module._get_fsdp_state()._fsdp_param_groups)


def reduce_over_shard_dim_only(module: FSDPModule) -> None:
    """Make ``module``'s parameter groups reduce gradients over the shard dimension only.

    For a NO_SHARD unit (a ``(replicas, 1)`` mesh) this turns off ``fully_shard``'s
    all-reduce over the replicate dimension, so a communication hook can do it instead.
    """
    for group in module._get_fsdp_state()._fsdp_param_groups:
        old = group.mesh_info
        shard_only = FSDPMeshInfo(old.mesh, shard_mesh_dim=old.shard_mesh_dim)
        if group.post_forward_mesh_info is old:
            group.post_forward_mesh_info = shard_only
        group.mesh_info = shard_only


def padded_shard_numels(module: nn.Module) -> dict[int, int]:
    """id(sharded parameter) -> elements ``fully_shard`` stores for it on this rank (padded).

    Covers every ``FSDPModule`` under ``module``; what cannot be read is left out.
    """
    sizes: dict[int, int] = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        try:
            groups = sub._get_fsdp_state()._fsdp_param_groups
        except AttributeError:
            continue
        for group in groups:
            for fsdp_param in group.fsdp_params:
                size = getattr(fsdp_param, "padded_sharded_param_size", None)
                sharded = getattr(fsdp_param, "sharded_param", None)
                if size is not None and sharded is not None:
                    sizes[id(sharded)] = math.prod(size)
    return sizes
