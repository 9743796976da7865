"""Clean names: a path through the wrapped module tree without the wrappers' own levels.

torch's state-dict helpers (``torch.distributed.checkpoint.state_dict``, ``_get_fqns``)
name a parameter by the path through the model with the levels that wrappers add left out:
DDP's ``module``, FSDP1's ``_fsdp_wrapped_module``, ``torch.compile``'s ``_orig_mod``,
activation checkpointing's ``_checkpoint_wrapped_module``, and the levels a module lists in
``_fqn_modifiers()``. :class:`PathCleaner` does the same for any path (modules too), telling
a wrapper's level by the object it leads to (the module the wrapper holds), not by its
spelling, so that it also sees FSDP1's level below a checkpoint wrapper (which
``_get_fqns`` takes for a module's name, while the state dict's keys leave it out).
Lightning's wrappers (Fabric's ``_FabricModule``, the Trainer's
``_LightningModuleWrapperBase``) are peeled off the top (:func:`peel`): their
``state_dict()`` is the wrapped module's, so the clean names are that module's.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.nn.parallel import DistributedDataParallel

from fsdp_interactive._torch_compat import (
    CHECKPOINT_WRAPPED_MODULE,
    FQN_MODIFIERS_METHOD,
    ActivationWrapper,
    compiled_module_inner,
    parameter_slots,
    submodule_slots,
)
from fsdp_interactive.fsdp import FullyShardedDataParallel
from fsdp_interactive.fsdp.fully_sharded_data_parallel import FSDP_WRAPPED_MODULE

#: (module, class) of Lightning's wrappers: each holds the user's module as
#: ``_forward_module``. Looked up only where Lightning is already imported.
LIGHTNING_WRAPPERS = (
    ("lightning.fabric.wrappers", "_FabricModule"),
    ("lightning_fabric.wrappers", "_FabricModule"),
    ("lightning.pytorch.overrides.base", "_LightningModuleWrapperBase"),
    ("pytorch_lightning.overrides.base", "_LightningModuleWrapperBase"),
)
LIGHTNING_INNER = "_forward_module"


def lightning_inner(module: nn.Module) -> nn.Module | None:
    """The module a Lightning wrapper holds, when ``module`` is one, else ``None``."""
    if isinstance(module, _lightning_classes(len(sys.modules))):
        return submodule_slots(module).get(LIGHTNING_INNER)
    return None


@functools.lru_cache(maxsize=1)
def _lightning_classes(imported: int) -> tuple[type, ...]:
    """Lightning's wrapper classes among the imported modules (``imported``: how many
    modules are imported, so that an import since the last call is seen)."""
    found = []
    for module_name, class_name in LIGHTNING_WRAPPERS:
        source = sys.modules.get(module_name)
        cls = getattr(source, class_name, None) if source is not None else None
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def wrapped_inner(module: nn.Module) -> nn.Module | None:
    """The module a wrapper whose level clean names leave out holds, when ``module`` is one
    (DDP, torch's or this package's FSDP, ``torch.compile``, activation checkpointing,
    Lightning), else ``None``."""
    if isinstance(module, DistributedDataParallel):
        return module.module
    if isinstance(module, (TorchFSDP, FullyShardedDataParallel)):
        return submodule_slots(module).get(FSDP_WRAPPED_MODULE)
    if isinstance(module, ActivationWrapper):
        return submodule_slots(module).get(CHECKPOINT_WRAPPED_MODULE)
    compiled = compiled_module_inner(module)
    if compiled is not None:
        return compiled
    return lightning_inner(module)


def peel(model: nn.Module) -> tuple[nn.Module, str, list[str]]:
    """``(root, prefix, wrappers)``: ``model`` without Lightning's wrappers around it, the
    prefix they add to wrapped names, and their class names (outermost first)."""
    root, prefix, wrappers = model, "", []
    while (inner := lightning_inner(root)) is not None:
        wrappers.append(type(root).__name__)
        root, prefix = inner, f"{prefix}{LIGHTNING_INNER}."
    return root, prefix, wrappers


class PathCleaner:
    """Clean paths under one root, each module level looked up once.

    ``_get_fqns``' rules, with a wrapper's level told by identity: a segment is left out
    where it leads from a wrapper to the module it holds, wherever that wrapper sits (torch's
    ``_get_fqns`` misses FSDP1's level below a checkpoint wrapper, whose ``state_dict()``
    keys leave it out). The last segment of a path is not looked up (a flat parameter's
    originals are not attributes while it is sharded). :meth:`clean` raises
    ``AttributeError`` when a path does not lead anywhere from the root. Modules must not
    be rearranged between calls.
    """

    def __init__(self, root: nn.Module):
        self._levels: dict[str, tuple[object, str]] = {"": (root, "")}
        self._inner: dict[int, nn.Module | None] = {}
        self._modifiers: dict[int, dict[str, str]] = {}

    def clean(self, path: str) -> str:
        if not path:
            return ""
        through, _, last = path.rpartition(".")
        here, clean = self._level(through)
        inner = self._inner_of(here)
        if inner is not None and submodule_slots(here).get(last) is inner:
            return clean
        return f"{clean}.{last}" if clean else last

    def _inner_of(self, here: object) -> nn.Module | None:
        if not isinstance(here, nn.Module):
            return None
        if id(here) not in self._inner:
            self._inner[id(here)] = wrapped_inner(here)
        return self._inner[id(here)]

    def _modifiers_of(self, here: object) -> dict[str, str]:
        """``here._fqn_modifiers()`` (``{}`` without one), asked once per module: a module
        may list every child in it."""
        if id(here) not in self._modifiers:
            method = getattr(here, FQN_MODIFIERS_METHOD, None)
            self._modifiers[id(here)] = method() if callable(method) else {}
        return self._modifiers[id(here)]

    def _level(self, path: str) -> tuple[object, str]:
        """(the object at ``path``, its clean path)."""
        known = self._levels.get(path)
        if known is not None:
            return known
        parent, _, segment = path.rpartition(".")
        here, clean = self._level(parent)
        inner = self._inner_of(here)
        if inner is not None and submodule_slots(here).get(segment) is inner:
            found: tuple[object, str] = (inner, clean)
        else:
            hidden = self._modifiers_of(here).get(segment)
            if hidden and hasattr(here, hidden):
                here = getattr(here, hidden)
            found = (getattr(here, segment), f"{clean}.{segment}" if clean else segment)
        self._levels[path] = found
        return found


def registered_parameters(root: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every parameter registered under ``root`` once, with the path where it is registered,
    in ``nn.Module.named_parameters()``'s order, read from the modules' own registries (a
    module may override ``named_parameters``; this does not ask it)."""
    seen_modules: set[int] = set()
    seen_params: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        prefix, module = stack.pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        for name, param in parameter_slots(module).items():
            if param is None or id(param) in seen_params:
                continue
            seen_params.add(id(param))
            yield f"{prefix}{name}", param
        children = [(f"{prefix}{n}.", c) for n, c in submodule_slots(module).items() if c]
        stack.extend(reversed(children))
