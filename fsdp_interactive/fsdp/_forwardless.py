"""Units around modules without a ``forward``: the enclosing unit's forward gathers them.

FSDP1 makes a unit of every module an auto-wrap policy selects, also of one that
implements no ``forward`` (a holder of layers that its parent calls one by one), and so
does this package, except for ``nn.ModuleList`` / ``nn.ModuleDict``, which ``fully_shard``
refuses (:func:`can_be_unit`). ``fully_shard`` gathers a module's parameters in that
module's own forward hooks, which never run for such a module: its parameters would stay
sharded when the parent's forward uses them (torch's FSDP1 fails there too, computing with
its sharded flat parameter). Here the nearest unit above it that
has a ``forward`` gathers them:

* before that unit's forward (after ``fully_shard``'s own pre-forward hook, which runs the
  root's lazy initialization first), every forward-less unit below it that no other unit
  with a ``forward`` encloses is unsharded (``FSDPModule.unshard()``, one all-gather each);
* after a forward without gradient recording they are resharded at once. After a forward
  that records gradients they stay whole until the backward ends: ``fully_shard``'s
  end-of-backward callback runs the post-backward (gradient reduction, then reshard) of
  every parameter group whose own hooks did not run, these included.

Cost: such a unit's all-gather is not prefetched, and its parameters stay whole from the
forward to the end of the backward (as under ``SHARD_GRAD_OP``). Not done: a
``summon_full_params`` between such a forward and its backward reshards them while the
autograd graph still refers to the whole parameters, and that backward then fails.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_interactive.fsdp._unit_state import unit_state

logger = logging.getLogger(__name__)


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` implements ``forward`` (``nn.ModuleList`` and friends do not)."""
    return type(module).forward is not nn.Module.forward


def can_be_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` accepts ``module``: it refuses ``nn.ModuleList`` and
    ``nn.ModuleDict`` without a ``forward`` of their own (torch 2.9 to 2.14). An auto-wrap
    policy that selects one (``always_wrap_policy``) gets no unit for it here, where FSDP1
    makes one; its children are still considered, and what it holds itself (parameters of
    children that are not units) is sharded by the unit above it, as FSDP1's unit would
    have sharded it, with nothing else to gather them for since it has no forward."""
    return has_forward(module) or not isinstance(module, nn.ModuleList | nn.ModuleDict)


def forwardless_units_below(module: nn.Module) -> list[FSDPModule]:
    """The sharded modules of the forward-less units below ``module`` that no unit with a
    ``forward`` below ``module`` encloses, in pre-order."""
    found: list[FSDPModule] = []
    seen: set[nn.Module] = set()

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if child in seen:
                continue
            seen.add(child)
            state = unit_state(child)
            if state is not None:
                if has_forward(state.sharded_module):
                    continue
                found.append(state.sharded_module)
            visit(child)

    visit(module)
    return found


def gather_forwardless_units(sharded_module: FSDPModule) -> None:
    """Make the forward of ``sharded_module`` (a unit's module, just sharded) gather the
    forward-less units below it; nothing when it has no ``forward`` or none are below."""
    if not has_forward(sharded_module):
        return
    below = forwardless_units_below(sharded_module)
    if not below:
        return
    logger.debug(
        "%s gathers %d unit(s) without forward in its forward: %s",
        type(sharded_module).__name__,
        len(below),
        ", ".join(type(m).__name__ for m in below),
    )

    def unshard(_module: nn.Module, _args: Any) -> None:
        for unit in below:
            unit.unshard()

    def reshard_unless_recording(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not torch.is_grad_enabled():
            for unit in below:
                unit.reshard()

    sharded_module.register_forward_pre_hook(unshard)
    sharded_module.register_forward_hook(reshard_unless_recording)
