"""Walking FSDP units in a module tree.

Other layers (state dicts, summoning, gradient clipping, probes) use these to find units
and what each owns without knowing how the wrapper stores them.
"""

from __future__ import annotations

import collections

from torch import nn

from fsdp_interactive._torch_compat import training_state_name
from fsdp_interactive.fsdp._unit_state import UnitState, is_unit, unit_state


def units(module: nn.Module) -> list[nn.Module]:
    """Every unit in ``module`` (``module`` included), in pre-order (``module.modules()``)."""
    return [m for m in module.modules() if is_unit(m)]


def unit_states(module: nn.Module) -> list[UnitState]:
    """The states of :func:`units` of ``module``, in the same order."""
    return [state for m in module.modules() if (state := unit_state(m)) is not None]


def root_units(module: nn.Module) -> list[nn.Module]:
    """Units in ``module`` that have no unit above them inside ``module``."""
    if is_unit(module):
        return [module]
    found: list[nn.Module] = []

    def visit(mod: nn.Module, seen: set[nn.Module]) -> None:
        for child in mod.children():
            if child in seen:
                continue
            seen.add(child)
            if is_unit(child):
                found.append(child)
            else:
                visit(child, seen)

    visit(module, {module})
    return found


def owned_modules(unit_root: nn.Module, ignored_modules: frozenset[nn.Module]) -> list[nn.Module]:
    """The modules whose own parameters and buffers the unit around ``unit_root`` owns.

    Breadth-first from ``unit_root``, stopping at units (already built below it) and at
    ignored modules.
    """
    owned = [unit_root]
    seen = {unit_root}
    queue = collections.deque([unit_root])
    while queue:
        for child in queue.popleft().children():
            if child in seen or child in ignored_modules or is_unit(child):
                continue
            seen.add(child)
            owned.append(child)
            queue.append(child)
    return owned


def busy_state(module: nn.Module) -> str | None:
    """``None`` when every unit in ``module`` is idle; else the name FSDP1's
    ``TrainingState`` gives what one is doing: ``"SUMMON_FULL_PARAMS"`` inside
    ``summon_full_params``, ``"FORWARD_BACKWARD"`` in a forward or a backward."""
    for state in unit_states(module):
        if state.summoning:
            return "SUMMON_FULL_PARAMS"
        if state.forward_depth or training_state_name(state.sharded_module) != "IDLE":
            return "FORWARD_BACKWARD"
    return None


def check_idle(module: nn.Module, what: str) -> None:
    """``ValueError`` unless every unit in ``module`` is idle: not in a forward, a backward
    or ``summon_full_params``. The type and the first words are FSDP1's
    (``_assert_state``: "expected to be in states [...] but current state is ...")."""
    busy = busy_state(module)
    if busy is not None:
        raise ValueError(
            "expected to be in states [<TrainingState.IDLE: 1>] but current state is "
            f"TrainingState.{busy}: {what} cannot be called during "
            f"{'summon_full_params()' if busy == 'SUMMON_FULL_PARAMS' else 'forward or backward'}"
        )
