"""The state of one FSDP unit, attached to the unit's module and looked up by function.

A *unit* is a module (a ``FullyShardedDataParallel`` instance) that owns the parameters of
its wrapped module that no nested unit owns and shards them with one ``fully_shard`` call.
Everything the package keeps per unit lives in one :class:`UnitState`, stored under one
attribute of the unit module; whether a module is a unit is whether it carries that state.
Every layer finds units and their state through :func:`unit_state` / :func:`is_unit`, so
none needs the wrapper class (this module imports nothing of the package but the config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_interactive.fsdp._config import UnitConfig

_STATE_ATTR = "_fsdp_unit_state"


@dataclass(frozen=True)
class IgnoredStates:
    """What FSDP leaves alone: whole modules (with all their submodules) and parameters."""

    modules: frozenset[nn.Module]
    params: frozenset[nn.Parameter]


@dataclass(eq=False)
class UnitState:
    """Per-unit state.

    ``sharded_module`` is the wrapped module as ``fully_shard`` left it. It stays the
    ``FSDPModule`` even if the unit's child is later replaced (activation checkpointing
    wraps it), so it is kept here rather than read from the module tree.
    """

    config: UnitConfig
    ignored: IgnoredStates
    sharded_module: FSDPModule
    has_parent: bool = False
    """Set on every unit once a unit above it is built around it: then it is not a root."""
    summoning: bool = False
    """Inside ``summon_full_params`` (forward raises there)."""
    forward_depth: int = 0
    """Forwards of this unit in progress (re-entrant calls count)."""
    forward_order: list[UnitState] | None = None
    """With ``forward_prefetch``, the root's record of the units' order in the first forward."""
    comm_hook: Callable | None = None
    """The communication hook registered by the user (one per model)."""
    comm_hook_runner: object = None
    """What ``fully_shard`` calls to run ``comm_hook`` (counts its calls)."""

    @property
    def is_root(self) -> bool:
        return not self.has_parent


def attach_state(unit: nn.Module, state: UnitState) -> None:
    """Make ``unit`` a unit with ``state`` (stored in its ``__dict__``, not as a submodule)."""
    unit.__dict__[_STATE_ATTR] = state


def unit_state(module: nn.Module) -> UnitState | None:
    """The state of ``module`` if it is a unit, else ``None``.

    Read from the module's own ``__dict__``: attribute fall-through to a wrapped module
    never makes a module look like a unit.
    """
    return module.__dict__.get(_STATE_ATTR)


def require_state(module: nn.Module) -> UnitState:
    """The state of ``module``; ``TypeError`` if it is not a unit."""
    state = unit_state(module)
    if state is None:
        raise TypeError(f"expected a FullyShardedDataParallel unit, got {type(module).__name__}")
    return state


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP unit."""
    return _STATE_ATTR in module.__dict__
