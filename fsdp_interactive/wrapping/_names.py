"""Clean names: a path through the wrapped module tree without the wrappers' own levels.

torch's state-dict helpers (``torch.distributed.checkpoint.state_dict``, ``_get_fqns``)
name a parameter by the path through the model with the levels that wrappers add left out:
DDP's ``module``, FSDP1's ``_fsdp_wrapped_module``, ``torch.compile``'s ``_orig_mod``,
activation checkpointing's ``_checkpoint_wrapped_module``, and the levels a module lists in
``_fqn_modifiers()``. :func:`clean_path` does the same for any path (modules too), telling
a wrapper's level by the object it leads to (the module the wrapper holds), not by its
spelling, so that it also sees FSDP1's level below a checkpoint wrapper (which
``_get_fqns`` takes for a module's name, while the state dict's keys leave it out). Lightning's wrappers (Fabric's ``_FabricModule``, the Trainer's
``_LightningModuleWrapperBase``) are peeled off the top (:func:`peel`): their
``state_dict()`` is the wrapped module's, so the clean names are that module's.
"""

from __future__ import annotations

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
    for module_name, class_name in LIGHTNING_WRAPPERS:
        source = sys.modules.get(module_name)
        cls = getattr(source, class_name, None) if source is not None else None
        if cls is not None and isinstance(module, cls):
            return submodule_slots(module).get(LIGHTNING_INNER)
    return None


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


def clean_path(root: nn.Module, path: str) -> str:
    """``path`` (a module's or a parameter's, from ``root``) without the wrappers' levels.

    ``_get_fqns``' rules, with a wrapper's level told by identity: a segment is left out
    where it leads from a wrapper to the module it holds, wherever that wrapper sits (torch's
    ``_get_fqns`` misses FSDP1's level below a checkpoint wrapper, whose ``state_dict()``
    keys leave it out). The last segment is not looked up (a flat parameter's originals
    are not attributes while it is sharded). ``AttributeError`` when ``path`` does not
    lead anywhere from ``root``.
    """
    if not path:
        return ""
    *through, last = path.split(".")
    names: list[str] = []
    here: object = root
    for segment in through:
        if isinstance(here, nn.Module):
            inner = wrapped_inner(here)
            child = getattr(here, segment)
            if inner is not None and child is inner:
                here = child
                continue
            modifiers = getattr(here, FQN_MODIFIERS_METHOD, None)
            hidden = modifiers().get(segment) if callable(modifiers) else None
            if hidden and hasattr(here, hidden):
                here = getattr(here, hidden)
        names.append(segment)
        here = getattr(here, segment)
    inner = wrapped_inner(here) if isinstance(here, nn.Module) else None
    if inner is not None and submodule_slots(here).get(last) is inner:
        return ".".join(names)
    names.append(last)
    return ".".join(names)


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
