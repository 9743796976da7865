"""FSDP1 constructor arguments resolved into what ``fully_shard`` takes.

:func:`resolve_config` is the one place a :class:`UnitConfig` is built: from the root's
arguments (:class:`UnitArgs`), and again for a submodule only where an auto-wrap policy
overrides some of them (:func:`config_for_module`). Mapping:

* ``sharding_strategy`` / ``process_group`` / ``device_mesh`` -> mesh and
  ``reshard_after_forward`` (see :mod:`._mesh`).
* ``mixed_precision`` -> ``MixedPrecisionPolicy(param_dtype, reduce_dtype,
  cast_forward_inputs)``; ``cast_root_forward_inputs`` is applied by the root wrapper itself;
  ``buffer_dtype`` casts the unit's buffers at construction (FSDP1 casts them at the first
  forward); ``keep_low_precision_grads=True`` cannot be honoured (``fully_shard`` always
  returns gradients in the parameter dtype) and warns once.
* ``cpu_offload=CPUOffload(offload_params=True)`` -> ``CPUOffloadPolicy`` with pinned memory
  only when the unit computes on an accelerator (a CPU rank on a GPU host does not pin).
* ``backward_prefetch``: ``BACKWARD_PRE`` is ``fully_shard``'s default (the next unit's
  all-gather is issued before this unit's gradient computation); ``None`` disables backward
  prefetching; ``BACKWARD_POST`` warns once and runs as ``BACKWARD_PRE``.
* ``forward_prefetch=True``: after the first forward, each unit explicitly prefetches the
  next unit in that forward's order (``set_modules_to_forward_prefetch``), like FSDP1 which
  also derives the order from the first iteration.
* ``limit_all_gathers``: ``True`` is what ``fully_shard`` always does (at most one unit's
  all-gather runs ahead); ``False`` warns once that the bound stays.
* ``use_orig_params``: ``fully_shard`` always keeps the original parameters (as sharded
  DTensors). An explicit ``False`` warns once that no flat parameters exist; FSDP1's
  default (the same ``False``, left unpassed) does not warn, since the user asked for
  nothing that behaves differently.

Warnings name only arguments the user passed with a value whose meaning changes here.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)

from fsdp_interactive.fsdp._mesh import ShardingLayout, resolve_layout

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a UserWarning the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=4)


class Unpassed:
    """The default of an argument whose explicit value warns: tells "left out" from "passed".

    Shows as the default it stands for (``repr``), so signatures and ``help()`` show FSDP1's
    documented default. :func:`passed_value` resolves it.
    """

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def passed_value(value: Any) -> tuple[Any, bool]:
    """``(value, True)`` for a passed value; ``(default, False)`` for an :class:`Unpassed`."""
    if isinstance(value, Unpassed):
        return value.value, False
    return value, True


@dataclass(frozen=True)
class UnitArgs:
    """The FSDP1 constructor arguments that configure one unit, normalized.

    ``sharding_strategy`` and ``cpu_offload`` hold FSDP1's defaults instead of ``None``. The
    same objects are handed to auto-wrap policies (:meth:`as_kwargs`), which return them
    unchanged unless they override them for a module.
    """

    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None
    sharding_strategy: ShardingStrategy  # None given: FULL_SHARD
    cpu_offload: CPUOffload  # None given: CPUOffload()
    backward_prefetch: BackwardPrefetch | None
    mixed_precision: MixedPrecision | None
    param_init_fn: Callable[[torch.nn.Module], None] | None
    device_id: int | torch.device | None
    sync_module_states: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    device_mesh: DeviceMesh | None

    def __post_init__(self) -> None:
        if self.sharding_strategy is None:
            object.__setattr__(self, "sharding_strategy", ShardingStrategy.FULL_SHARD)
        if self.cpu_offload is None:
            object.__setattr__(self, "cpu_offload", CPUOffload())

    def as_kwargs(self) -> dict[str, Any]:
        """The arguments as FSDP1 constructor keywords (the same objects, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class UnitConfig:
    """Everything one unit needs to be built: its arguments and what they resolve to."""

    args: UnitArgs
    layout: ShardingLayout
    device: torch.device
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.layout.strategy

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        return self.args.mixed_precision

    @property
    def reshard_after_forward(self) -> bool | None:
        """``None`` for strategies that free after forward: FSDP1 keeps the root's parameters
        unsharded from forward to backward and frees every other unit's; ``fully_shard``'s
        ``None`` does exactly that, deciding the root lazily."""
        return None if self.layout.reshard_after_forward else False


def resolve_config(
    args: UnitArgs, device: torch.device, base: UnitConfig | None = None
) -> UnitConfig:
    """The config of a unit built with ``args`` computing on ``device``.

    With ``base``, its mesh is reused when ``args`` ask for the same strategy and groups
    (building a mesh can be collective).
    """
    if (
        base is not None
        and args.sharding_strategy == base.args.sharding_strategy
        and args.process_group is base.args.process_group
        and args.device_mesh is base.args.device_mesh
    ):
        layout = base.layout
    else:
        layout = resolve_layout(
            args.sharding_strategy, device.type, args.process_group, args.device_mesh
        )
        logger.debug(
            "%s: %d-D mesh of shape %s over ranks %s (dims %s)",
            layout.strategy.name,
            layout.mesh.ndim,
            tuple(layout.mesh.shape),
            layout.mesh.mesh.tolist(),
            layout.mesh.mesh_dim_names,
        )
    return UnitConfig(
        args=args,
        layout=layout,
        device=device,
        mp_policy=mixed_precision_policy(args.mixed_precision),
        offload_policy=offload_policy(args.cpu_offload, device),
    )


def config_for_module(root: UnitConfig, policy_kwargs: dict[str, Any]) -> UnitConfig:
    """The config of a unit an auto-wrap policy chose with ``policy_kwargs``: the root's,
    unless the policy changed some arguments for this module."""
    root_kwargs = root.args.as_kwargs()
    overrides = {
        name: value
        for name, value in policy_kwargs.items()
        if name in root_kwargs and value is not root_kwargs[name]
    }
    if not overrides:
        return root
    logger.debug("auto-wrap policy overrides %s for a unit", sorted(overrides))
    return resolve_config(dataclasses.replace(root.args, **overrides), root.device, base=root)


def mixed_precision_policy(mp: MixedPrecision | None) -> MixedPrecisionPolicy:
    if mp is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        output_dtype=None,
        cast_forward_inputs=mp.cast_forward_inputs,
    )


def offload_policy(cpu_offload: CPUOffload, device: torch.device) -> OffloadPolicy:
    """``fully_shard``'s offload policy for a unit computing on ``device``.

    Offloaded shards are pinned only when the unit computes on an accelerator, where
    pinning speeds up the copies to it. A CPU rank never pins, even on a host with GPUs:
    pinning allocates through the accelerator's host allocator, which creates a context
    on its current device (GPU 0) in every such rank.
    """
    if cpu_offload.offload_params:
        return CPUOffloadPolicy(pin_memory=device.type not in ("cpu", "meta"))
    return OffloadPolicy()


def warn_unhonoured(args: UnitArgs, use_orig_params_passed: bool) -> None:
    """Warn once per process for every passed argument the engine runs differently.

    Each condition is one the user can only reach by passing a value: FSDP1's defaults
    (``limit_all_gathers=True``, ``BACKWARD_PRE``, ``keep_low_precision_grads=False``, an
    unpassed ``use_orig_params``) never warn.
    """
    mixed_precision = args.mixed_precision
    if mixed_precision is not None and mixed_precision.keep_low_precision_grads:
        warn_once(
            "keep_low_precision_grads",
            "MixedPrecision(keep_low_precision_grads=True) is not supported: fully_shard "
            "casts reduced gradients back to the parameter dtype, so .grad stays in the "
            "original (full) precision",
        )
    if args.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        warn_once(
            "backward_post",
            "backward_prefetch=BACKWARD_POST is not available on fully_shard: the next "
            "unit's all-gather is issued before the current unit's gradient computation "
            "(BACKWARD_PRE) instead",
        )
    if not args.limit_all_gathers:
        warn_once(
            "limit_all_gathers",
            "limit_all_gathers=False has no effect: fully_shard always bounds the all-gathers "
            "in flight (at most one unit ahead of compute)",
        )
    if use_orig_params_passed and not args.use_orig_params:
        warn_once(
            "use_orig_params",
            "use_orig_params=False: fully_shard has no flat parameters; named_parameters() "
            "and optimizers see the original parameters as sharded DTensors, as with "
            "use_orig_params=True",
        )
