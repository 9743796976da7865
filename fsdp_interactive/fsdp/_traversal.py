"""Finding FSDP units in a module tree.

A *unit* is one ``FullyShardedDataParallel`` instance: it owns the parameters of its wrapped
module that no nested unit owns, and shards them with one ``fully_shard`` group. These
helpers are what other layers (state dicts, probes) use to walk units without knowing how
the wrapper stores them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from fsdp_interactive.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is a ``FullyShardedDataParallel`` unit."""
    from fsdp_interactive.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def units(module: nn.Module) -> list[FullyShardedDataParallel]:
    """Every unit in ``module`` (``module`` included), in pre-order (``module.modules()``)."""
    return [m for m in module.modules() if is_unit(m)]  # type: ignore[misc]


def root_units(module: nn.Module) -> list[FullyShardedDataParallel]:
    """Units in ``module`` that have no unit above them inside ``module``."""
    found: list[FullyShardedDataParallel] = []

    def visit(mod: nn.Module, seen: set[nn.Module]) -> None:
        for child in mod.children():
            if child in seen:
                continue
            seen.add(child)
            if is_unit(child):
                found.append(child)  # type: ignore[arg-type]
            else:
                visit(child, seen)

    if is_unit(module):
        return [module]  # type: ignore[list-item]
    visit(module, {module})
    return found


def iter_nested_units(unit: nn.Module) -> Iterator[FullyShardedDataParallel]:
    """Units strictly below ``unit``."""
    for m in unit.modules():
        if m is not unit and is_unit(m):
            yield m  # type: ignore[misc]
