"""Constructor argument checks, run before anything is modified.

Every check raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value, conflicting
arguments, objects outside the wrapped tree; as in FSDP1 also ``ignored_modules`` holding
something else than modules and ``ignored_states`` mixing parameters and modules) with the
argument's name in the message. FSDP1 itself checks few types: a mistyped argument there
fails later, by accident (``AttributeError``, ``KeyError``), or is taken as it is. They
run before the module is touched, so a rejected call leaves the module exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)

from fsdp_interactive._torch_compat import Policy
from fsdp_interactive.fsdp._unit_state import IgnoredStates, is_unit


def _type_name(value: object) -> str:
    return type(value).__name__


def check_types(
    *,
    module: object,
    process_group: object,
    sharding_strategy: object,
    cpu_offload: object,
    auto_wrap_policy: object,
    backward_prefetch: object,
    mixed_precision: object,
    param_init_fn: object,
    device_id: object,
    flags: dict[str, object],
    device_mesh: object,
) -> None:
    """Type checks for every scalar/config argument of the constructor."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel needs an initialized default process group "
            "(torch.distributed.init_process_group)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {_type_name(module)}")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        pair = (
            isinstance(process_group, tuple)
            and len(process_group) == 2
            and all(isinstance(g, dist.ProcessGroup) for g in process_group)
        )
        if not pair:
            raise TypeError(
                "process_group must be a ProcessGroup, an (intra_node, inter_node) tuple of "
                f"ProcessGroups, or None; got {_type_name(process_group)}"
            )
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh or None, got {_type_name(device_mesh)}")
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "process_group and device_mesh are mutually exclusive: pass one of them (or neither)"
        )
    for name, value, cls in (
        ("sharding_strategy", sharding_strategy, ShardingStrategy),
        ("cpu_offload", cpu_offload, CPUOffload),
        ("backward_prefetch", backward_prefetch, BackwardPrefetch),
        ("mixed_precision", mixed_precision, MixedPrecision),
    ):
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__} or None, got {_type_name(value)}")
    if (
        auto_wrap_policy is not None
        and not isinstance(auto_wrap_policy, Policy)
        and not callable(auto_wrap_policy)
    ):
        raise TypeError(
            "auto_wrap_policy must be a ModuleWrapPolicy/CustomPolicy, a callable "
            f"(module, recurse, nonwrapped_numel) -> bool, or None; got {_type_name(auto_wrap_policy)}"
        )
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(
            f"param_init_fn must be a callable (module) -> None, got {_type_name(param_init_fn)}"
        )
    if device_id is not None and (
        isinstance(device_id, bool) or not isinstance(device_id, int | str | torch.device)
    ):
        raise TypeError(
            "device_id must be an int, a torch.device, a device string such as 'cpu' or "
            f"'cuda:0', or None; got {_type_name(device_id)}"
        )
    if isinstance(device_id, int) and device_id < 0:
        raise ValueError(f"device_id must be a non-negative device index, got {device_id}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {_type_name(value)}")
    if mixed_precision is not None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            dtype = getattr(mixed_precision, field)
            if dtype is not None and not (
                isinstance(dtype, torch.dtype) and dtype.is_floating_point
            ):
                raise TypeError(
                    f"mixed_precision.{field} must be a floating-point torch.dtype or None, "
                    f"got {dtype!r}"
                )


def device_id_as_device(device_id: int | str | torch.device | None) -> int | torch.device | None:
    """``device_id`` with a device string turned into a ``torch.device`` (FSDP1 passes any
    ``device_id`` that is not a ``torch.device`` to ``torch.device()``); ints and devices
    are returned as they are. A string that names no device raises ``RuntimeError``, the
    error ``torch.device()`` itself raises, with the argument named."""
    if not isinstance(device_id, str):
        return device_id
    try:
        return torch.device(device_id)
    except RuntimeError as err:
        raise RuntimeError(f"device_id={device_id!r} is not a device: {err}") from None


def _as_list(name: str, value: Any) -> list[Any]:
    if isinstance(value, nn.Module | torch.Tensor) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name} must be an iterable (list, set, ...) of "
            f"{'modules' if name == 'ignored_modules' else 'parameters or modules'}, "
            f"got {_type_name(value)}"
        )
    return list(value)


def resolve_ignored(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None,
) -> IgnoredStates:
    """Normalize ``ignored_modules`` / ``ignored_states`` into modules and parameters.

    Ignored modules expand to all of their submodules, and their parameters are ignored.
    Objects must lie inside ``module``; the root itself and FSDP units cannot be ignored.
    """
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "ignored_modules and ignored_states are mutually exclusive: pass one of them "
            "(ignored_states accepts modules or parameters)"
        )
    own_modules = set(module.modules())
    own_params = set(module.parameters())
    mods: list[nn.Module] = []
    params: list[nn.Parameter] = []
    if ignored_modules is not None:
        items = _as_list("ignored_modules", ignored_modules)
        for item in items:
            if not isinstance(item, nn.Module):
                raise ValueError(
                    f"ignored_modules must contain only nn.Module objects, got {_type_name(item)}"
                )
        mods = items
        arg = "ignored_modules"
    elif ignored_states is not None:
        items = _as_list("ignored_states", ignored_states)
        if all(isinstance(i, nn.Parameter) for i in items):
            params = items
        elif all(isinstance(i, nn.Module) for i in items):
            mods = items
        else:
            kinds = sorted({_type_name(i) for i in items})
            raise ValueError(
                "ignored_states must contain only nn.Parameter objects or only nn.Module "
                f"objects, got a mix of {kinds}"
            )
        arg = "ignored_states"
    else:
        return IgnoredStates(frozenset(), frozenset())
    for mod in mods:
        if mod not in own_modules:
            raise ValueError(f"{arg} contains a {_type_name(mod)} that is not inside module")
        if mod is module:
            raise ValueError(f"{arg} cannot contain the wrapped module itself")
        if is_unit(mod):
            raise ValueError(f"{arg} cannot contain FullyShardedDataParallel units")
    for param in params:
        if param not in own_params:
            raise ValueError(f"{arg} contains a parameter that is not inside module")
    all_mods = {sub for mod in mods for sub in mod.modules()}
    all_params = set(params) | {p for mod in all_mods for p in mod.parameters()}
    return IgnoredStates(frozenset(all_mods), frozenset(all_params))
