"""FSDP1 constructor arguments resolved into what ``fully_shard`` takes.

:func:`resolve_config` turns the user's (already type-checked) arguments into a frozen
:class:`UnitConfig` shared by a root and the units auto-wrapping builds under it. Mapping:

* ``sharding_strategy`` / ``process_group`` / ``device_mesh`` -> mesh and
  ``reshard_after_forward`` (see :mod:`._mesh`).
* ``mixed_precision`` -> ``MixedPrecisionPolicy(param_dtype, reduce_dtype,
  cast_forward_inputs)``; ``cast_root_forward_inputs`` is applied by the root wrapper itself;
  ``buffer_dtype`` casts the unit's buffers at construction (FSDP1 casts them at the first
  forward); ``keep_low_precision_grads=True`` cannot be honoured (``fully_shard`` always
  returns gradients in the parameter dtype) and warns once.
* ``cpu_offload=CPUOffload(offload_params=True)`` -> ``CPUOffloadPolicy`` with pinned memory
  only when an accelerator exists.
* ``backward_prefetch``: ``BACKWARD_PRE`` is ``fully_shard``'s default (the next unit's
  all-gather is issued before this unit's gradient computation); ``None`` disables backward
  prefetching; ``BACKWARD_POST`` warns once and runs as ``BACKWARD_PRE``.
* ``forward_prefetch=True``: after the first forward, each unit explicitly prefetches the
  next unit in that forward's order (``set_modules_to_forward_prefetch``), like FSDP1 which
  also derives the order from the first iteration.
* ``limit_all_gathers``: ``True`` is what ``fully_shard`` always does (at most one unit's
  all-gather runs ahead); ``False`` warns once that the bound stays.
* ``use_orig_params``: ``fully_shard`` always keeps the original parameters (as sharded
  DTensors); ``False`` warns once that no flat parameters exist.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)

from fsdp_interactive.fsdp._mesh import ShardingLayout

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a UserWarning the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=4)


@dataclass(frozen=True)
class UnitConfig:
    """Everything one unit needs to be built, shared by a root and its auto-wrapped units."""

    layout: ShardingLayout
    device: torch.device
    mixed_precision: MixedPrecision | None
    mp_policy: MixedPrecisionPolicy
    cpu_offload: CPUOffload
    offload_policy: OffloadPolicy
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    param_init_fn: Callable[[torch.nn.Module], None] | None
    sync_module_states: bool

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.layout.strategy

    @property
    def reshard_after_forward(self) -> bool | None:
        """``None`` for strategies that free after forward: FSDP1 keeps the root's parameters
        unsharded from forward to backward and frees every other unit's; ``fully_shard``'s
        ``None`` does exactly that, deciding the root lazily."""
        return None if self.layout.reshard_after_forward else False


def mixed_precision_policy(mp: MixedPrecision | None) -> MixedPrecisionPolicy:
    if mp is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        output_dtype=None,
        cast_forward_inputs=mp.cast_forward_inputs,
    )


def offload_policy(cpu_offload: CPUOffload) -> OffloadPolicy:
    if cpu_offload.offload_params:
        return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    return OffloadPolicy()


def warn_unhonoured(
    mixed_precision: MixedPrecision | None,
    backward_prefetch: BackwardPrefetch | None,
    limit_all_gathers: bool,
    use_orig_params: bool,
) -> None:
    """Warn once per process for every argument the engine runs differently from FSDP1."""
    if mixed_precision is not None and mixed_precision.keep_low_precision_grads:
        warn_once(
            "keep_low_precision_grads",
            "MixedPrecision(keep_low_precision_grads=True) is not supported: fully_shard "
            "casts reduced gradients back to the parameter dtype, so .grad stays in the "
            "original (full) precision",
        )
    if backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        warn_once(
            "backward_post",
            "backward_prefetch=BACKWARD_POST is not available on fully_shard: the next "
            "unit's all-gather is issued before the current unit's gradient computation "
            "(BACKWARD_PRE) instead",
        )
    if not limit_all_gathers:
        warn_once(
            "limit_all_gathers",
            "limit_all_gathers=False has no effect: fully_shard always bounds the all-gathers "
            "in flight (at most one unit ahead of compute)",
        )
    if not use_orig_params:
        warn_once(
            "use_orig_params",
            "use_orig_params=False: fully_shard has no flat parameters; named_parameters() "
            "and optimizers see the original parameters as sharded DTensors, as with "
            "use_orig_params=True",
        )
