"""A unit's forward: FSDP1's root input cast and forward prefetch on top of ``fully_shard``.

``fully_shard``'s own hooks gather and free parameters; what is added here:

* the root casts floating-point inputs to ``param_dtype`` under mixed precision when
  ``cast_root_forward_inputs`` (FSDP1's default) is set;
* with ``forward_prefetch``, the root's first forward records the order in which units run,
  then sets each unit to prefetch the next one (FSDP1 also takes the order from the first
  iteration);
* every unit counts its forwards in progress, so calls that need idle units can refuse to
  run inside one (:func:`._traversal.check_idle`);
* forward inside ``summon_full_params`` raises ``RuntimeError``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import map_tree
from fsdp_interactive.fsdp._traversal import unit_states
from fsdp_interactive.fsdp._unit_state import UnitState


def unit_forward(
    unit: nn.Module, state: UnitState, wrapped: nn.Module, args: Any, kwargs: Any
) -> Any:
    """Run ``wrapped`` (the unit's child) as the forward of ``unit``."""
    if state.summoning:
        raise RuntimeError(
            "forward() inside summon_full_params() is not supported: exit the context first"
        )
    mp = state.config.mixed_precision
    if (
        state.is_root
        and mp is not None
        and mp.param_dtype is not None
        and mp.cast_root_forward_inputs
    ):
        args, kwargs = _cast_floating(mp.param_dtype, (args, kwargs))
    if state.is_root and state.config.args.forward_prefetch and state.forward_order is None:
        return _forward_recording_order(unit, state, wrapped, args, kwargs)
    return _counted_forward(state, wrapped, args, kwargs)


def _counted_forward(state: UnitState, wrapped: nn.Module, args: Any, kwargs: Any) -> Any:
    state.forward_depth += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        state.forward_depth -= 1


def _forward_recording_order(
    unit: nn.Module, state: UnitState, wrapped: nn.Module, args: Any, kwargs: Any
) -> Any:
    """First forward: record unit order, then set each unit to prefetch the next one."""
    order: list[UnitState] = []
    handles = [
        other.sharded_module.register_forward_pre_hook(
            lambda _m, _a, other=other: order.append(other) if other not in order else None
        )
        for other in unit_states(unit)
    ]
    try:
        out = _counted_forward(state, wrapped, args, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    for current, following in itertools.pairwise(order):
        current.sharded_module.set_modules_to_forward_prefetch([following.sharded_module])
    state.forward_order = order
    return out


def _cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.is_floating_point():
            return x.to(dtype)
        return x

    return map_tree(cast, tree)
