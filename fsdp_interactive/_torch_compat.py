"""Every private torch name fsdp_interactive uses, read in this one module (rank side).

Torch promises nothing for names with a leading underscore, for public-looking names in
private modules (``torch.distributed.fsdp._fully_shard``), or for attributes of private
classes (``fully_shard``'s ``FSDPState``, ``FSDPParamGroup``, ``FSDPParam``). The rest of
the package reaches them only through the names below, so a torch upgrade touches this
module alone. Each entry says what it is for, where torch keeps it and the torch versions
it was checked on; where versions differ it has one branch per version, each doing the
same thing.

"Checked" means: the package's tests ran on these torch releases (the PyPI wheels of 2.9.1
and 2.14.1, the CPU build of 2.13.0: what CI runs). For the two entries that differ between
versions, the tests of this module, fsdp/, inspect/ and checkpoint/ also ran on 2.11.0 and
2.12.1 (the last release of one side and the first of the other), and the sources of 2.10.0
were read.

``tests/test_torch_compat.py`` exercises every entry on the running torch (signatures and
attributes included), so a torch release that moves one fails the test named after it. A
torch that lacks an imported name outright fails the import of this module with an
``ImportError`` naming the torch name and this module.

Not done: no entry substitutes an empty or default value for one torch has; an entry that
cannot do its job on the running torch raises.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.api import MixedPrecision, ShardingStrategy
from torch.distributed.tensor import DTensor, Placement

#: The torch releases the package's tests ran on (see the module docstring).
CHECKED_ON = ("2.9.1", "2.13.0", "2.14.1")


def _torch_name(module: str, name: str) -> Any:
    """``module.name`` on the running torch; an ImportError naming both if torch lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"torch {torch.__version__} has no {module}.{name}, which fsdp_interactive uses "
            f"(fsdp_interactive/_torch_compat.py; checked on torch {', '.join(CHECKED_ON)})"
        ) from exc


# ---------------------------------------------------------------------------- torch core

#: ``torch._utils._flatten_dense_tensors``: one flat tensor from many (sync_module_states
#: broadcasts one bucket per dtype). checked: 2.9.1, 2.13.0, 2.14.1
flatten_dense_tensors: Callable[..., torch.Tensor] = _torch_name(
    "torch._utils", "_flatten_dense_tensors"
)
#: ``torch._utils._unflatten_dense_tensors``: views of a flat tensor shaped like the originals.
#: checked: 2.9.1, 2.13.0, 2.14.1
unflatten_dense_tensors: Callable[..., tuple[torch.Tensor, ...]] = _torch_name(
    "torch._utils", "_unflatten_dense_tensors"
)
#: ``torch.utils._pytree.tree_map``: map over nested (args, kwargs) structures (casting root
#: forward inputs). checked: 2.9.1, 2.13.0, 2.14.1 (none has a public ``torch.utils.pytree``)
map_tree: Callable[..., Any] = _torch_name("torch.utils._pytree", "tree_map")


def foreach_norm(
    tensors: list[torch.Tensor], norm_type: float, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """One norm per tensor in a single fused call (``torch._foreach_norm``).

    checked: 2.9.1, 2.13.0, 2.14.1 (the ``dtype`` keyword on each)
    """
    if dtype is None:
        return list(torch._foreach_norm(tensors, norm_type))
    return list(torch._foreach_norm(tensors, norm_type, dtype=dtype))


def flight_recorder_dump() -> Callable[[bool, bool, bool], bytes] | None:
    """``torch._C._distributed_c10d._dump_fr_trace``: the flight recorder's pickled dump.

    Called as ``(include_collectives, include_stack_traces, only_active)``; the bytes
    unpickle to a dict with ``"entries"``. ``None`` on a torch built without
    ``torch.distributed``, or one without the recorder (the caller says so to the user).
    checked: 2.9.1, 2.13.0, 2.14.1
    """
    import torch.distributed as dist

    if not dist.is_available():
        return None
    c10d = importlib.import_module("torch._C._distributed_c10d")
    return getattr(c10d, "_dump_fr_trace", None)


def collective_device_type(group: Any = None) -> str:
    """The device type torch itself picks for collectives of objects on ``group`` (``None``:
    the default group): ``distributed_c10d._get_object_coll_device``.

    One backend (``"gloo"``, ``"nccl"``): its device type; several (``"cpu:gloo,cuda:nccl"``):
    ``"cpu"`` if one of them is CPU, else the first; none registered yet: ``"cpu"``. So a
    group that can communicate CPU tensors answers ``"cpu"``, an NCCL-only group ``"cuda"``.
    checked: 2.9.1, 2.13.0, 2.14.1 (the same rule on each)
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_object_coll_device(group)


# ---------------------------------------------------------------------------- nn.Module

#: ``torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX``: the state-dict key of
#: ``get_extra_state``. checked: 2.9.1, 2.13.0, 2.14.1
EXTRA_STATE_KEY_SUFFIX: str = _torch_name("torch.nn.modules.module", "_EXTRA_STATE_KEY_SUFFIX")

#: The hook registries ``nn.Module.__init__`` creates: what the rollback of a failed wrap
#: restores. checked: 2.9.1, 2.13.0, 2.14.1 (these eleven on each, and no other)
MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module._parameters``: the module's own parameters by name, the live dict.

    Writing into it replaces a parameter without ``register_parameter``'s checks.
    checked: 2.9.1, 2.13.0, 2.14.1
    """
    return module._parameters


def buffer_slots(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module._buffers``: the module's own buffers by name, the live dict.

    checked: 2.9.1, 2.13.0, 2.14.1
    """
    return module._buffers


def submodule_slots(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module._modules``: the module's direct children by name, the live dict.

    Read from the instance ``__dict__``, so that it is safe inside a ``__getattr__``; a
    module whose ``nn.Module.__init__`` has not run has no children yet (``{}``).
    checked: 2.9.1, 2.13.0, 2.14.1
    """
    return vars(module).get("_modules", {})


def move_own_states(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s own parameters and buffers (not its submodules') to ``device``
    (``nn.Module._apply`` without recursion). checked: 2.9.1, 2.13.0, 2.14.1
    """
    module._apply(lambda t: t.to(device), recurse=False)


# ---------------------------------------------------------------------------- DTensor

_compute_local_shape_and_global_offset = _torch_name(
    "torch.distributed.tensor._utils", "_compute_local_shape_and_global_offset"
)
_compute_local_shape_and_global_offset_here = _torch_name(
    "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"
)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (no autograd), else ``tensor``.

    Reads ``DTensor._local_tensor``: ``to_local()`` goes through an autograd function on
    every call, which dominates a probe over a few hundred parameters, and returns a view
    rather than the stored tensor. checked: 2.9.1, 2.13.0, 2.14.1
    """
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place writes the storage this rank holds for ``tensor`` has seen:
    ``Tensor._version`` of the local tensor (a DTensor's local shard), shared by its views.

    Tells a state-dict placeholder that something (a DCP load) wrote into it from one that
    nothing did. checked: 2.9.1, 2.13.0, 2.14.1
    """
    return local_tensor(tensor)._version


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of the piece of a ``global_shape`` tensor sharded by
    ``placements`` over ``mesh`` that the rank at ``coordinate`` of the mesh holds.

    ``coordinate=None``: this rank (which must belong to ``mesh``). Shapes are unpadded.
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (this rank)
    and ``_compute_local_shape_and_global_offset`` (any coordinate, given as a list).
    checked: 2.9.1, 2.13.0, 2.14.1 (2.13 adds a ``skip_offset`` keyword, not used here)
    """
    if coordinate is None:
        shape, offset = _compute_local_shape_and_global_offset_here(global_shape, mesh, placements)
    else:
        shape, offset = _compute_local_shape_and_global_offset(
            global_shape, tuple(mesh.shape), list(coordinate), placements
        )
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


# ---------------------------------------------------------------------------- ShardedTensor

#: ``torch.distributed._shard.sharded_tensor.ShardedTensor``: FSDP1's sharded state-dict
#: values (and what ``load_sharded_optimizer_state_dict`` returns), accepted as load input.
#: checked: 2.9.1, 2.13.0, 2.14.1
ShardedTensor: type = _torch_name("torch.distributed._shard.sharded_tensor", "ShardedTensor")


def sharded_tensor_group(value: Any) -> Any:
    """The process group a ``ShardedTensor`` is sharded over (``ShardedTensor._process_group``;
    ``None`` stands for the default group). checked: 2.9.1, 2.13.0, 2.14.1
    """
    return value._process_group


# ---------------------------------------------------------------------------- FSDP1 names

#: ``torch.distributed.fsdp.wrap._Policy``: the base of ``ModuleWrapPolicy`` and
#: ``CustomPolicy``. checked: 2.9.1, 2.13.0, 2.14.1
Policy: type = _torch_name("torch.distributed.fsdp.wrap", "_Policy")
#: ``torch.distributed.fsdp.wrap._or_policy(module, recurse, nonwrapped_numel, policies)``:
#: FSDP1's auto-wrap adds the mixed-precision override classes to a callable policy with it.
#: checked: 2.9.1, 2.13.0, 2.14.1
or_policy: Callable[..., bool] = _torch_name("torch.distributed.fsdp.wrap", "_or_policy")
#: ``torch.distributed.fsdp.wrap._wrap_module_cls_individually(module, module_classes,
#: recurse, ...)``. checked: 2.9.1, 2.13.0, 2.14.1
wrap_module_cls_individually: Callable[..., bool] = _torch_name(
    "torch.distributed.fsdp.wrap", "_wrap_module_cls_individually"
)
#: ``torch.distributed.fsdp.wrap._run_mixed_precision_override_policy(root_module,
#: module_classes, ignored_modules, root_kwargs, target_module_to_kwargs)``.
#: checked: 2.9.1, 2.13.0, 2.14.1
run_mixed_precision_override_policy: Callable[..., dict[nn.Module, dict[str, Any]]] = _torch_name(
    "torch.distributed.fsdp.wrap", "_run_mixed_precision_override_policy"
)
#: ``torch.distributed.fsdp._common_utils._override_module_mixed_precision(root,
#: module_classes_to_override)``: registers the float32 cast hooks, returns the classes.
#: checked: 2.9.1, 2.13.0, 2.14.1
override_module_mixed_precision: Callable[..., set[type]] = _torch_name(
    "torch.distributed.fsdp._common_utils", "_override_module_mixed_precision"
)
#: ``torch.distributed.fsdp._wrap_utils._warn_on_overridden_mixed_precision(classes)``.
#: checked: 2.9.1, 2.13.0, 2.14.1
warn_on_overridden_mixed_precision: Callable[[set[type]], None] = _torch_name(
    "torch.distributed.fsdp._wrap_utils", "_warn_on_overridden_mixed_precision"
)


def run_policy(
    policy: Any, root: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict
) -> dict[nn.Module, dict]:
    """The modules ``policy`` wraps under ``root`` with their constructor keywords
    (``_Policy._run_policy``, what FSDP1's auto-wrap calls). checked: 2.9.1, 2.13.0, 2.14.1
    """
    return policy._run_policy(root, ignored_modules, root_kwargs)


def module_classes_without_mixed_precision(mp: MixedPrecision) -> tuple[type, ...]:
    """The module classes FSDP1 keeps in full precision under ``mp`` (batch norm by default):
    ``MixedPrecision._module_classes_to_ignore``. checked: 2.9.1, 2.13.0, 2.14.1
    """
    return tuple(mp._module_classes_to_ignore)


#: ``ShardingStrategy._HYBRID_SHARD_ZERO2``: a private member of the public enum, accepted as
#: FSDP1 does. checked: 2.9.1, 2.13.0, 2.14.1
HYBRID_SHARD_ZERO2: ShardingStrategy = ShardingStrategy._HYBRID_SHARD_ZERO2

#: ``torch.distributed.algorithms._comm_hooks.default_hooks``: torch's FSDP1 communication
#: hooks (``DefaultState``, ``allreduce_hook``, ``reduce_scatter_hook``,
#: ``fp16_compress_hook``, ``bf16_compress_hook``). checked: 2.9.1, 2.13.0, 2.14.1
default_hooks = _torch_name("torch.distributed.algorithms._comm_hooks", "default_hooks")

#: ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper``: the base
#: of activation checkpointing's wrappers. checked: 2.9.1, 2.13.0, 2.14.1
ActivationWrapper: type = _torch_name(
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"
)
#: ``..._checkpoint.checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE``: the attribute of a
#: checkpoint wrapper holding the wrapped module, so clean names and
#: ``FullyShardedDataParallel.module`` see through it. checked: 2.9.1, 2.13.0, 2.14.1
CHECKPOINT_WRAPPED_MODULE: str = _torch_name(
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "_CHECKPOINT_WRAPPED_MODULE"
)


# ---------------------------------------------------------------------------- fully_shard

#: ``torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter``: the interface a custom
#: reduce-scatter implements (``FSDPModule.set_custom_reduce_scatter``): ``allocate(size, *,
#: dtype, device)`` and ``__call__(output_tensor, input_tensor, group, op, async_op=False)``,
#: called with keywords. checked: 2.9.1, 2.13.0, 2.14.1
ReduceScatter: type = _torch_name("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter")
_FSDPMeshInfo = _torch_name("torch.distributed.fsdp._fully_shard._fsdp_common", "FSDPMeshInfo")


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The parameter groups (``FSDPParamGroup``) ``fully_shard`` made for ``module`` itself.

    ``module._get_fsdp_state()`` holds them as ``_fsdp_param_groups`` (a list) from torch
    2.12 on, and as ``_fsdp_param_group`` (one group or ``None``: ``fully_shard`` made at
    most one group per module there) up to 2.11. Empty when ``fully_shard`` manages no
    parameter of ``module`` itself. The group attributes read or set here (``mesh_info``,
    ``post_forward_mesh_info``, ``fsdp_params``; per parameter ``sharded_param``,
    ``padded_sharded_param_size``) are the same on every version.
    checked: 2.9.1, 2.11.0 (one group), 2.12.1, 2.13.0, 2.14.1 (list); sources: 2.10.0 (one
    group)
    """
    state = module._get_fsdp_state()
    groups = vars(state).get("_fsdp_param_groups")
    if groups is not None:
        return list(groups)
    if "_fsdp_param_group" not in vars(state):
        raise AttributeError(
            f"torch {torch.__version__}: fully_shard's state has neither _fsdp_param_groups "
            f"nor _fsdp_param_group (fsdp_interactive/_torch_compat.py; checked on torch "
            f"{', '.join(CHECKED_ON)})"
        )
    group = state._fsdp_param_group
    return [] if group is None else [group]


def has_sharded_params(module: FSDPModule) -> bool:
    """Whether ``fully_shard`` manages any parameter of ``module`` (it has a parameter group)."""
    return bool(fsdp_param_groups(module))


def reduce_over_shard_dim_only(module: FSDPModule) -> None:
    """Make ``module``'s parameter groups reduce gradients over the shard dimension only.

    For a NO_SHARD unit (a ``(replicas, 1)`` mesh) this turns off ``fully_shard``'s
    all-reduce over the replicate dimension, so a communication hook can do it instead:
    each group's ``mesh_info`` (and ``post_forward_mesh_info`` where it is the same object)
    becomes an ``FSDPMeshInfo(mesh, shard_mesh_dim=...)`` of the same mesh (``FSDPMeshInfo``
    from ``torch.distributed.fsdp._fully_shard._fsdp_common``). checked: 2.9.1, 2.13.0,
    2.14.1
    """
    for group in fsdp_param_groups(module):
        old = group.mesh_info
        shard_only = _FSDPMeshInfo(old.mesh, shard_mesh_dim=old.shard_mesh_dim)
        if group.post_forward_mesh_info is old:
            group.post_forward_mesh_info = shard_only
        group.mesh_info = shard_only


def padded_shard_numels(module: nn.Module) -> dict[int, int]:
    """id(sharded parameter) -> elements ``fully_shard`` stores for it on this rank (padded),
    for every ``FSDPModule`` under ``module`` (``FSDPParam.sharded_param``,
    ``padded_sharded_param_size``). checked: 2.9.1, 2.13.0, 2.14.1
    """
    sizes: dict[int, int] = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        for group in fsdp_param_groups(sub):
            for fsdp_param in group.fsdp_params:
                sizes[id(fsdp_param.sharded_param)] = math.prod(
                    fsdp_param.padded_sharded_param_size
                )
    return sizes


def training_state_name(module: FSDPModule) -> str:
    """``fully_shard``'s training state of ``module``: ``"IDLE"``, ``"FORWARD"``,
    ``"PRE_BACKWARD"`` or ``"POST_BACKWARD"`` (``_get_fsdp_state()._training_state``).
    checked: 2.9.1, 2.13.0, 2.14.1 (these four states on each)
    """
    return module._get_fsdp_state()._training_state.name


# ---------------------------------------------------------------------------- torch FSDP1

#: ``torch.distributed.fsdp._flat_param.FlatParameter``: torch FSDP1's flat parameter (an
#: ``isinstance`` check; instances are ``nn.Parameter``s). checked: 2.9.1, 2.13.0, 2.14.1
FlatParameter: type = _torch_name("torch.distributed.fsdp._flat_param", "FlatParameter")


def fsdp1_flat_param(module: nn.Module) -> tuple[Any, torch.Tensor] | None:
    """The ``FlatParameter`` torch's FSDP1 ``module`` manages itself and this rank's shard of
    it, padding included, also while unsharded (``module._handle.flat_param``,
    ``_local_shard``, set at the first forward; the parameter's data before it, which FSDP1
    sharded at construction; the whole of it under NO_SHARD); ``None`` when it manages none.
    checked: 2.9.1, 2.13.0, 2.14.1
    """
    handle = module._handle
    if handle is None:
        return None
    flat_param = handle.flat_param
    return flat_param, vars(flat_param).get("_local_shard", flat_param.data)


def fsdp1_pieces(flat_param: Any) -> list[tuple[str, torch.Size, int, int, int, Any]]:
    """Per original parameter of ``flat_param``, in order: (FQN below the unit's wrapped
    module, shape, where this rank's piece starts in the local shard, where it starts in
    the flattened parameter, its length, the original ``nn.Parameter`` under
    ``use_orig_params=True`` else ``None``); ``(0, 0, 0)`` where this rank holds none of
    it (``_fqns``, ``_shapes``, ``_shard_param_infos``, ``_params``).
    checked: 2.9.1, 2.13.0, 2.14.1
    """
    originals = flat_param._params or [None] * len(flat_param._fqns)
    infos = flat_param._shard_param_infos
    return [
        (fqn, shape, i.offset_in_shard, i.intra_param_start_idx, i.numel_in_shard, original)
        if i.in_shard
        else (fqn, shape, 0, 0, 0, original)
        for fqn, shape, i, original in zip(
            flat_param._fqns, flat_param._shapes, infos, originals, strict=True
        )
    ]


def fsdp1_replicate_group(module: nn.Module) -> Any:
    """The group torch FSDP1 ``module`` reduces over between HYBRID_SHARD replicas
    (``_inter_node_pg``), else ``None``. checked: 2.9.1, 2.13.0, 2.14.1"""
    return vars(module).get("_inter_node_pg")


def is_fsdp1_managed(tensor: torch.Tensor) -> bool:
    """Whether torch FSDP1 flattened or made ``tensor`` (``_fsdp_flattened``).
    checked: 2.9.1, 2.13.0, 2.14.1"""
    return bool(getattr(tensor, "_fsdp_flattened", False))


def compiled_module_inner(module: nn.Module) -> nn.Module | None:
    """What ``torch.compile`` compiled when ``module`` is its ``OptimizedModule``
    (``torch._dynamo.eval_frame``, ``_orig_mod``), else ``None``; never imports dynamo
    (without it nothing is compiled). checked: 2.9.1, 2.13.0, 2.14.1
    """
    frames = sys.modules.get("torch._dynamo.eval_frame")
    compiled = frames is not None and isinstance(module, frames.OptimizedModule)
    return module._orig_mod if compiled else None


# ---------------------------------------------------------------------------- checkpoints

#: ``torch.distributed.checkpoint._traverse.set_element(root, path, value)``: set a value in
#: a nested state dict by DCP object path. checked: 2.9.1, 2.13.0, 2.14.1
set_element: Callable[..., None] = _torch_name(
    "torch.distributed.checkpoint._traverse", "set_element"
)
#: ``torch.distributed.checkpoint.state_dict._get_fqns(model, name)``: the keys the DCP state
#: dict helpers use for a parameter name. checked: 2.9.1, 2.13.0, 2.14.1
get_fqns: Callable[..., set[str]] = _torch_name(
    "torch.distributed.checkpoint.state_dict", "_get_fqns"
)
#: The method through which a module tells :data:`get_fqns` which attribute levels do not
#: appear in clean names (``_get_fqns``'s ``dsd_fqn_modifiers`` default).
#: checked: 2.9.1, 2.13.0, 2.14.1
FQN_MODIFIERS_METHOD = "_fqn_modifiers"

#: The private globals DCP's pickled ``.metadata`` refers to, as (module, name) -> object:
#: ``filesystem._StorageInfo``, ``serialization._get_layout``, ``metadata._MEM_FORMAT_ENCODING``.
#: checked: 2.9.1, 2.13.0, 2.14.1
DCP_METADATA_PRIVATE_GLOBALS: dict[tuple[str, str], Any] = {
    (module, name): _torch_name(module, name)
    for module, name in (
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    )
}


def _skips_missing_optimizer_state() -> bool:
    """Whether torch's ``set_optimizer_state_dict`` passes over, under ``strict=False``, a
    parameter the state dict has no state for: from 2.10 on (2.9 raises ``KeyError``)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.10"


def set_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    *,
    options: Any = None,
) -> None:
    """torch's ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``, where
    ``options.strict=False`` admits parameters without state on every admitted torch.

    A parameter listed in ``optim_state_dict["param_groups"]`` without an entry in its
    ``"state"`` (torch's optimizers create state lazily, on a parameter's first step) ends
    with no state, as torch 2.10+ does by itself. torch 2.9 raises ``KeyError`` there: on
    it, each such parameter gets an empty entry for the load, and its state is removed
    from the optimizer after it, so the optimizer ends with the same state as on 2.10+.
    checked: 2.9.1 (empty entries), 2.11.0, 2.12.1, 2.13.0, 2.14.1 (torch alone); sources:
    2.10.0 (torch alone)
    """
    from torch.distributed.checkpoint.state_dict import (
        set_optimizer_state_dict as torch_set_optimizer_state_dict,
    )

    strict = True if options is None else options.strict
    state = optim_state_dict.get("state")
    listed = [key for group in optim_state_dict.get("param_groups", []) for key in group["params"]]
    missing = set() if state is None else {key for key in listed if key not in state}
    if strict or not missing or _skips_missing_optimizer_state():
        torch_set_optimizer_state_dict(model, optimizer, optim_state_dict, options=options)
        return
    params_by_key = {
        key: param for name, param in model.named_parameters() for key in get_fqns(model, name)
    }
    padded = {**optim_state_dict, "state": {**state, **{key: {} for key in missing}}}
    torch_set_optimizer_state_dict(model, optimizer, padded, options=options)
    for key in missing:
        param = params_by_key.get(key)
        if param is not None:
            optimizer.state.pop(param, None)


# ---------------------------------------------------------------------------- NCCL


def nccl_flight_recorder_dump() -> Callable[..., bytes] | None:
    """``torch._C._distributed_c10d._dump_nccl_trace``: NCCL's own flight recorder, pickled.

    ProcessGroupNCCL records into a recorder of its own (``FlightRecorderCUDA``, with
    CUDA events that tell whether each collective completed on the GPU), which
    :func:`flight_recorder_dump` (the generic recorder gloo uses) does not see. Called as
    ``(include_collectives, include_stack_traces, only_active)``; the bytes unpickle to a
    dict with ``"entries"`` and ``"pg_status"`` laid out as the generic recorder's, and
    ``"nccl_comm_state"``. ``None`` on a torch built without NCCL (CPU builds, macOS).
    checked: 2.9.1, 2.14.1 (PyPI's CUDA builds: present, three optional keyword flags
    ``includeCollectives``, ``includeStackTraces``, ``onlyActive``); 2.13.0 CPU build:
    absent; sources: 2.13 (``ProcessGroupNCCL.cpp`` ``dump_nccl_trace`` dumps
    ``FlightRecorderCUDA``)
    """
    import torch.distributed as dist

    if not dist.is_available():
        return None
    c10d = importlib.import_module("torch._C._distributed_c10d")
    return getattr(c10d, "_dump_nccl_trace", None)


def extend_nccl_timeouts(seconds: float) -> None:
    """Give every NCCL process group of this rank ``seconds`` more before its watchdog
    times out a collective: those in flight now and those issued until the first one
    issued after this call completes (``distributed_c10d._add_ephemeral_timeout_for_all_pgs``,
    ``ProcessGroupNCCL._add_ephemeral_timeout``). Extensions add up. A no-op for groups
    of other backends (gloo has no watchdog that ends the process) and on a torch
    without NCCL.
    checked: 2.9.1, 2.13.0 (CPU build: the function exists, no NCCL group to extend),
    2.14.1; sources: 2.13 (``ProcessGroupNCCL::assignTimeoutToWork``, the watchdog's
    ``checkTimeout(opTimeout_ + ephemeralTimeoutActive_)``)
    """
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    if seconds <= 0:
        return
    distributed_c10d._add_ephemeral_timeout_for_all_pgs(timedelta(seconds=float(seconds)))


def cuda_device_count_without_init() -> int | None:
    """CUDA devices this process would see, counted through NVML without initialising
    CUDA (no ``cuInit``, so ``CUDA_VISIBLE_DEVICES`` may still be changed afterwards):
    ``torch.cuda._device_count_nvml`` (honours ``CUDA_VISIBLE_DEVICES``, indices and
    UUIDs). ``0`` on a torch without CUDA; ``None`` when NVML cannot tell (no NVML
    library, MIG devices, a ROCm build): the caller must count another way.
    checked: 2.9.1, 2.13.0, 2.14.1 (returns a negative number when NVML fails)
    """
    import torch.cuda

    if getattr(torch.version, "hip", None):
        return None  # ROCm counts through amdsmi, which this entry does not read
    if torch.version.cuda is None:
        return 0
    try:
        count = int(torch.cuda._device_count_nvml())
    except Exception:
        return None
    return count if count >= 0 else None
