"""``register_comm_hook``: FSDP1 communication hooks on ``fully_shard``'s reduction path.

FSDP1 calls a registered hook instead of its own gradient reduction, with no pre/post
division of its own (the hook divides, e.g. through ``DefaultState``):

* sharded units (FULL_SHARD, SHARD_GRAD_OP): ``hook(state, grad, output)``, where ``grad`` is
  the unit's flat, padded, unsharded local gradient laid out rank chunk after rank chunk and
  ``output`` receives this rank's reduced chunk. Here the hook becomes the unit's custom
  reduce-scatter (``FSDPModule.set_custom_reduce_scatter``); ``fully_shard``'s own division is
  switched off (``set_gradient_divide_factor(1.0)``).
* NO_SHARD units: ``hook(state, grad)`` reduces the whole local gradient in place. The NO_SHARD
  mesh has a shard dimension of size one, so the reduce-scatter is a copy and the engine's
  native all-reduce over the replicate dimension would follow. The unit's parameter group
  is switched to a shard-only view of the same mesh (so the native all-reduce does not run)
  and the hook runs as its all-reduce hook (``set_all_reduce_hook``). This relies on
  ``fully_shard``'s parameter-group internals (``mesh_info``), checked by the tests.

Torch's default hooks (``torch.distributed.algorithms._comm_hooks.default_hooks``:
``allreduce_hook``, ``reduce_scatter_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``)
follow these signatures. The two compression hooks call ``Tensor.record_stream``, which CPU
tensors do not support (so they fail on CPU under torch's FSDP1 too); on a CPU compute device
they are replaced by :func:`low_precision_hook`, which does the same casts and reductions
without stream bookkeeping. As in FSDP1 (the same error types and words): root only, one
registration per model, hybrid strategies are not supported (``AssertionError`` each), the
hook must be callable (``ValueError``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.api import ShardingStrategy

from fsdp_interactive._torch_compat import (
    ReduceScatter,
    default_hooks,
    has_sharded_params,
    reduce_over_shard_dim_only,
)
from fsdp_interactive.fsdp._mesh import HYBRID_STRATEGIES
from fsdp_interactive.fsdp._traversal import check_idle, unit_states
from fsdp_interactive.fsdp._unit_state import require_state


def low_precision_hook(
    dtype: torch.dtype,
    state: default_hooks.DefaultState,
    grad: torch.Tensor,
    output: torch.Tensor | None = None,
) -> None:
    """Torch's fp16/bf16 compression hook without ``record_stream`` (usable on CPU).

    Reduces ``grad`` cast to ``dtype`` with torch's ``reduce_scatter_hook`` (into ``output``)
    or ``allreduce_hook`` (in place), then writes the result back in the original dtype.
    """
    low = grad.to(dtype)
    if output is None:
        default_hooks.allreduce_hook(state, low)
        grad.copy_(low)
    else:
        low_out = torch.empty_like(output, dtype=dtype)
        default_hooks.reduce_scatter_hook(state, low, low_out)
        output.copy_(low_out)


_CPU_REPLACEMENTS = {
    default_hooks.fp16_compress_hook: functools.partial(low_precision_hook, torch.float16),
    default_hooks.bf16_compress_hook: functools.partial(low_precision_hook, torch.bfloat16),
}


def _for_device(hook: Callable[..., None], device: torch.device) -> Callable[..., None]:
    """``hook``, or its CPU-capable equivalent (see the module docstring)."""
    if device.type == "cpu":
        return _CPU_REPLACEMENTS.get(hook, hook)
    return hook


class HookReduceScatter(ReduceScatter):
    """A ``fully_shard`` reduce-scatter that calls an FSDP1 hook ``hook(state, grad, output)``.

    ``calls`` counts invocations (the reduction really went through the hook).
    """

    def __init__(self, state: object, hook: Callable[..., None]):
        self.state = state
        self.hook = hook
        self.calls = 0

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        self.calls += 1
        self.hook(self.state, input_tensor, output_tensor)


class HookAllReduce:
    """A ``fully_shard`` all-reduce hook that calls an FSDP1 hook ``hook(state, grad)``."""

    def __init__(self, state: object, hook: Callable[..., None]):
        self.state = state
        self.hook = hook
        self.calls = 0

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.calls += 1
        self.hook(self.state, reduce_output)


def register_comm_hook(root: nn.Module, state: object, hook: Callable[..., None]) -> None:
    """Install ``hook`` on every unit of the unit ``root`` (see the module docstring)."""
    root_state = require_state(root)
    if not root_state.is_root:
        raise AssertionError("register_comm_hook can only be called on a root instance.")
    all_units = unit_states(root)
    for unit in all_units:
        if unit.config.sharding_strategy in HYBRID_STRATEGIES:
            raise AssertionError(
                "Communication hook is not supported for hybrid strategies: "
                f"{unit.config.sharding_strategy}"
            )
        if unit.comm_hook is not None:
            raise AssertionError("A communication hook is already registered")
    if not callable(hook):
        raise ValueError(f"The communication hook must be callable but got {hook}")
    check_idle(root, "register_comm_hook()")
    user_hook = hook
    hook = _for_device(hook, root_state.config.device)
    for unit in all_units:
        unit.comm_hook = user_hook
        inner = unit.sharded_module
        if not has_sharded_params(inner):
            continue
        if unit.config.sharding_strategy == ShardingStrategy.NO_SHARD:
            runner: HookReduceScatter | HookAllReduce = HookAllReduce(state, hook)
            reduce_over_shard_dim_only(inner)
            inner.set_all_reduce_hook(runner)
        else:
            runner = HookReduceScatter(state, hook)
            inner.set_custom_reduce_scatter(runner)
        inner.set_gradient_divide_factor(1.0)
        unit.comm_hook_runner = runner
