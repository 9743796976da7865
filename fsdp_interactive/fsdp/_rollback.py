"""Undo a partly-built FSDP wrap when construction fails.

``fully_shard`` changes modules in place: it swaps each managed module's class, replaces its
parameters with sharded DTensors, registers forward hooks and stores its state in the
module's ``__dict__``. Auto-wrapping also replaces children with units. If any step fails
(a raising ``param_init_fn``, a policy error, a collective error), :class:`TreeSnapshot`
puts every module of the tree back: class, parameter and buffer objects, children, hooks and
instance attributes, so the caller gets back the exact module objects it passed in.

Not undone: in-place changes to tensor *data* (a device move by ``fully_shard`` moves
parameters by replacing them, which is undone; materialized meta parameters are replaced by
their original meta parameters). A failure inside a collective may also leave the process
group unusable; that is outside this module's reach.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdp_interactive._torch_compat import (
    MODULE_HOOK_DICTS,
    buffer_slots,
    parameter_slots,
    submodule_slots,
)


@dataclass
class _ModuleRecord:
    cls: type
    attrs: dict[str, Any]
    params: OrderedDict
    buffers: OrderedDict
    children: OrderedDict
    hooks: dict[str, OrderedDict]


class TreeSnapshot:
    """Shallow record of every module under ``root`` (tensors are referenced, not copied)."""

    def __init__(self, root: nn.Module):
        self._records: dict[nn.Module, _ModuleRecord] = {}
        for module in root.modules():
            self._records[module] = _ModuleRecord(
                cls=module.__class__,
                attrs=dict(module.__dict__),
                params=OrderedDict(parameter_slots(module)),
                buffers=OrderedDict(buffer_slots(module)),
                children=OrderedDict(submodule_slots(module)),
                hooks={
                    name: OrderedDict(getattr(module, name))
                    for name in MODULE_HOOK_DICTS
                    if isinstance(getattr(module, name, None), dict)
                },
            )

    def restore(self) -> None:
        """Put every recorded module back as it was when the snapshot was taken."""
        for module, record in self._records.items():
            module.__class__ = record.cls
            for name in list(module.__dict__):
                if name not in record.attrs:
                    del module.__dict__[name]
            module.__dict__.update(record.attrs)
            for current, saved in (
                (parameter_slots(module), record.params),
                (buffer_slots(module), record.buffers),
                (submodule_slots(module), record.children),
            ):
                current.clear()
                current.update(saved)
            for name, saved in record.hooks.items():
                current = getattr(module, name)
                current.clear()
                current.update(saved)
