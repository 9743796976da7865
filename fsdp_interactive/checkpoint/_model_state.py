"""Model and optimizer state of a model however it is wrapped, keyed by clean FQNs.

Checkpoints and snapshots name every value as ``torch.distributed.checkpoint.state_dict``
does (its FQN rule, :data:`~fsdp_interactive._torch_compat.get_fqns`): the segments of
DDP (``module.``), torch FSDP1 (``_fsdp_wrapped_module.``, and a flat parameter stands
for the original parameters it holds), ``torch.compile`` (``_orig_mod.``), activation
checkpointing (``_checkpoint_wrapped_module.``) and the ``_fqn_modifiers`` of this
package's wrapper are dropped. So a checkpoint of one wrapping loads into another
wrapping of the same architecture (torch FSDP1 into ``fully_shard`` and back, DDP into
either).

A Lightning Fabric module (``_FabricModule``, whose ``_forward_module.`` segment torch's
rule does not know) is read through the module it runs, the strategy's (DDP, or the
``fully_shard``-ed model itself); accelerate wraps with torch's own classes.

Values are what torch's helpers give for the wrapping: DTensors (``fully_shard``, this
package's wrapper, torch FSDP1 built with a ``device_mesh``), ``ShardedTensor`` (torch
FSDP1 otherwise), plain tensors (DDP, an unwrapped module). DCP saves and reshards each.

What this layer adds to torch's helpers: the state of this package's wrapper is read
and written natively (:func:`~fsdp_interactive.fsdp._raw_state_dict.raw_state_dict`), and
an optimizer without state yet is neither stepped on save nor on load (DCP initialises
empty optimizer state by a zero-learning-rate ``step()``; torch FSDP1 optimizers are the
exception on load, where torch's own conversion needs that state).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from fsdp_interactive._torch_compat import get_fqns, set_optimizer_state_dict
from fsdp_interactive.checkpoint.errors import UnsupportedModelError
from fsdp_interactive.fsdp import _fqn_state
from fsdp_interactive.fsdp._raw_state_dict import raw_state_dict
from fsdp_interactive.wrapping._path_cleaner import peel


def unwrapped(model: nn.Module) -> nn.Module:
    """The module torch's state-dict helpers are given for ``model``: the module inside
    Lightning's wrappers (Fabric's ``_FabricModule``: what Fabric's strategy wrapped), as
    :mod:`fsdp_interactive.wrapping` finds it; ``model`` itself otherwise."""
    return peel(model)[0]


def model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict, sharded, by clean FQN (torch's helper, read natively).

    :class:`UnsupportedModelError` (the same on every rank) for a model that a checkpoint
    cannot represent: see :func:`check_supported`.
    """
    model = unwrapped(model)
    check_supported(model)
    return _fqn_state.model_state(model)


def apply_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a sharded model state dict keyed by clean FQNs into ``model`` (non-strict:
    the callers compare the keys first)."""
    _fqn_state.apply_model_state(unwrapped(model), state, strict=False)


def check_supported(model: nn.Module) -> None:
    """Refuse a torch FSDP1 module that shards over one rank of several.

    FSDP1 then switches to ``NO_SHARD`` over that one-rank group: every rank keeps its own
    full copy and no gradient is reduced across ranks, so the copies drift apart
    (measured with torch 2.13 on CPU ranks: different values on the two ranks after one
    step, for ``HYBRID_SHARD`` over a device mesh of shape (2, 1) and for ``HYBRID_SHARD``
    without a device mesh, where torch counts one CPU device per host). A checkpoint
    would keep one rank's copy. Raised alike on every rank.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP1

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    for name, module in model.named_modules():
        group = getattr(module, "process_group", None)
        if isinstance(module, TorchFSDP1) and group is not None and group.size() == 1:
            raise UnsupportedModelError(
                f"the torch FullyShardedDataParallel module {name or '(the root)'!r} shards "
                f"over 1 of the {world} ranks, so every rank trains a copy of its own that "
                "no checkpoint can hold (HYBRID_SHARD with one rank per shard group; on CPU "
                "ranks also HYBRID_SHARD without device_mesh, as torch counts one device per "
                "host); build it with device_mesh=init_device_mesh(device_type, (replicas, "
                "shards)) and shards > 1, or use FULL_SHARD"
            )


def param_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter)`` -> the clean FQNs it holds: one for a parameter, every original
    parameter's (sorted) for a torch FSDP1 flat parameter. A parameter reachable under
    several names (tied weights) keeps its first."""
    model = unwrapped(model)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), sorted(get_fqns(model, name)))
    return names


def optimizer_param_groups(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    names: dict[int, list[str]] | None = None,
) -> list[list[str]]:
    """Clean FQNs of each parameter group's parameters, in the optimizer's order
    (``names``: :func:`param_names` of ``model``, when the caller has it already).

    ``ValueError`` if the optimizer holds a parameter that is not one of the model's.
    """
    names = param_names(model) if names is None else names
    held = [[id(p) for p in group["params"]] for group in optimizer.param_groups]
    if any(key not in names for group in held for key in group):
        raise ValueError("the optimizer holds a parameter that is not a parameter of the model")
    return [[fqn for key in group for fqn in names[key]] for group in held]


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``, sharded.

    Parameters without optimizer state yet are absent from ``"state"``; an optimizer with
    no state at all gives its groups only, and is not stepped to make any.
    """
    model = unwrapped(model)
    if not any(optimizer.state.values()):  # no parameter has state yet
        groups = optimizer_param_groups(model, optimizer)
        hyper = optimizer.state_dict()["param_groups"]
        return {
            "state": {},
            "param_groups": [
                {**group, "params": names} for group, names in zip(hyper, groups, strict=True)
            ],
        }
    with raw_state_dict():
        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=False)
        )


def holds_torch_fsdp1(model: nn.Module) -> bool:
    """Whether any module of ``model`` is torch's own ``FullyShardedDataParallel``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP1

    return any(isinstance(m, TorchFSDP1) for m in model.modules())


def apply_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    names: dict[int, list[str]] | None = None,
) -> None:
    """Load sharded optimizer state keyed by clean FQNs (as :func:`optimizer_state` makes;
    ``names``: :func:`param_names` of ``model``, when the caller has it already).

    torch FSDP1 models go through torch's ``set_optimizer_state_dict``, which converts
    per-parameter state into flat-parameter state. Every other wrapping holds one optimizer
    parameter per clean FQN and loads through
    :func:`fsdp_interactive.fsdp._fqn_state.apply_optimizer_state` (no zero-gradient step
    first), whose names (only ``_fqn_modifiers`` segments dropped) are matched to the clean
    ones by parameter.
    """
    model = unwrapped(model)
    if holds_torch_fsdp1(model):
        # strict=False: parameters without optimizer state yet are legitimate (torch's
        # optimizers create state lazily); parameter groups are checked by the callers.
        with raw_state_dict():
            set_optimizer_state_dict(
                model, optimizer, state, options=StateDictOptions(strict=False)
            )
        return
    kit_names = {
        clean: kit
        for clean_group, kit_group in zip(
            optimizer_param_groups(model, optimizer, names),
            _fqn_state.optimizer_param_groups(model, optimizer),
            strict=True,
        )
        for clean, kit in zip(clean_group, kit_group, strict=True)
    }
    renamed = {
        "state": {kit_names.get(k, k): v for k, v in state.get("state", {}).items()},
        "param_groups": [
            {**g, "params": [kit_names.get(p, p) for p in g["params"]]}
            for g in state.get("param_groups", [])
        ],
    }
    _fqn_state.apply_optimizer_state(model, optimizer, renamed)
