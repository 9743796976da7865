"""Building one unit: from a module and its resolved config to a sharded, stateful unit.

:func:`setup_unit` runs, in order, on the modules the new unit owns (its module's tree,
minus nested units built before it and ignored modules):

1. meta-device states are materialized (see :mod:`._init`);
2. with ``sync_module_states``, parameters and buffers are broadcast from the mesh's first
   rank;
3. with ``MixedPrecision.buffer_dtype``, floating-point buffers are cast to it;
4. ``fully_shard`` shards the parameters over the unit's mesh;
5. if the unit's module has a ``forward``, it is made to gather the units without one below
   it (see :mod:`._forwardless`);
6. the unit's state is attached and the state-dict hooks installed.

Nothing here is undone on failure: the constructor snapshots the tree first.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.fsdp import MixedPrecision, fully_shard

from fsdp_interactive._torch_compat import buffer_slots
from fsdp_interactive.fsdp import _init, _state_dict_utils
from fsdp_interactive.fsdp._config import UnitConfig
from fsdp_interactive.fsdp._forwardless import gather_forwardless_units
from fsdp_interactive.fsdp._traversal import owned_modules
from fsdp_interactive.fsdp._unit_state import IgnoredStates, UnitState, attach_state

logger = logging.getLogger(__name__)


def setup_unit(
    unit: nn.Module, module: nn.Module, config: UnitConfig, ignored: IgnoredStates
) -> UnitState:
    """Make ``unit`` the unit around ``module`` (already its child); the unit's state."""
    owned = owned_modules(module, ignored.modules)
    kind = type(module).__name__  # fully_shard swaps the class for an FSDP subclass
    materialized = _init.has_meta_states(owned, ignored.params)
    if materialized:
        _init.materialize(owned, config.args.param_init_fn, config.device, ignored.params)
    if config.args.sync_module_states:
        _init.broadcast_from_rank0(owned, ignored.params, config.layout.mesh)
    _cast_buffers(owned, config.mixed_precision)
    ignored_here = {p for p in module.parameters() if p in ignored.params}
    fully_shard(
        module,
        mesh=config.layout.mesh,
        reshard_after_forward=config.reshard_after_forward,
        mp_policy=config.mp_policy,
        offload_policy=config.offload_policy,
        ignored_params=ignored_here or None,
    )
    if materialized:
        _init.release_freed_memory()  # the unit's full tensors, now sharded
    gather_forwardless_units(module)
    if config.args.backward_prefetch is None:
        # An explicit list disables fully_shard's implicit next-unit prefetch; prefetching
        # the unit itself is a no-op (it is already unsharded when its backward starts).
        module.set_modules_to_backward_prefetch([module])
    state = UnitState(config=config, ignored=ignored, sharded_module=module)
    attach_state(unit, state)
    _state_dict_utils.install_state_dict_hooks(unit)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "unit around %s: %d module(s), %d parameter(s) sharded with %s over a mesh of "
            "shape %s%s",
            kind,
            len(owned),
            sum(1 for m in owned for p in m.parameters(recurse=False) if p not in ignored.params),
            config.sharding_strategy.name,
            tuple(config.layout.mesh.shape),
            " (materialized from meta)" if materialized else "",
        )
    return state


def _cast_buffers(owned: list[nn.Module], mp: MixedPrecision | None) -> None:
    """Cast the owned floating-point buffers to ``mp.buffer_dtype`` (if set)."""
    if mp is None or mp.buffer_dtype is None:
        return
    for module in owned:
        for name, buf in buffer_slots(module).items():
            if buf is None or not buf.is_floating_point() or buf.dtype == mp.buffer_dtype:
                continue
            buffer_slots(module)[name] = buf.to(mp.buffer_dtype)
