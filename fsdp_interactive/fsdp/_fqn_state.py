"""Model and optimizer state as plain nested dicts keyed by clean parameter FQNs.

Thin layer over ``torch.distributed.checkpoint.state_dict`` (``get/set_model_state_dict``,
``get/set_optimizer_state_dict``, ``StateDictOptions``). Used by the FSDP1
optimizer-state-dict family and by checkpoints.

What this layer adds:

* **Full values streamed to the CPU.** Full values are gathered here from DCP's sharded
  state, one DTensor at a time with :func:`~._comm_device.gather_full`, each moved to the
  CPU before the next gather when asked. DCP's own ``full_state_dict=True`` offloads only
  together with rank 0 only (its ``cpu_offload`` means both), so full values on every
  rank would first be whole on each GPU; torch FSDP1 streams unit by unit.

* **Clean FQNs for optimizer state.** DCP keys optimizer state by ``named_parameters()``
  names, which keep a wrapper's inner-module segment (e.g. ``module.``). Here a name
  segment is dropped when the parent module lists that child in ``_fqn_modifiers()``'s
  values (the same rule DCP applies to model keys), so model and optimizer keys agree.
* **No side effect on a fresh optimizer.** DCP initialises empty optimizer state by
  running a zero-lr ``step()`` (Adam's step counter becomes 1). When the optimizer has no
  state yet, :func:`optimizer_state` returns ``{"state": {}, "param_groups": [...]}``
  without touching it, as torch FSDP1 does. Loading sharded state into such an
  optimizer skips that step as well (:func:`apply_optimizer_state`): it only made state
  that the load replaces, and took seconds for a 124M-parameter AdamW.
* **Native state whatever the state-dict type.** Every read and write runs inside
  :func:`~fsdp_interactive.fsdp._raw_state_dict.raw_state_dict`, so the FSDP1-style
  hooks never reshape what these functions see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import FQN_MODIFIERS_METHOD, get_fqns, set_optimizer_state_dict
from fsdp_interactive.fsdp._comm_device import gather_full
from fsdp_interactive.fsdp._raw_state_dict import raw_state_dict


def _hidden_children(module: nn.Module) -> set[str]:
    modifiers = getattr(module, FQN_MODIFIERS_METHOD, None)
    if modifiers is None or not callable(modifiers):
        return set()
    return set(modifiers().values())


def clean_module_names(model: nn.Module) -> dict[str, str]:
    """Raw module path (as in ``named_modules()``) -> clean path (wrapper segments dropped)."""
    clean: dict[str, str] = {"": ""}
    for raw_name, module in model.named_modules(remove_duplicate=False):
        hidden = _hidden_children(module)
        base = clean[raw_name]
        for child_name, _ in module.named_children():
            raw_child = f"{raw_name}.{child_name}" if raw_name else child_name
            if child_name in hidden:
                clean[raw_child] = base
            else:
                clean[raw_child] = f"{base}.{child_name}" if base else child_name
    return clean


def param_fqns(model: nn.Module) -> dict[str, str]:
    """``named_parameters()`` name -> clean parameter FQN, for every parameter of ``model``."""
    modules = clean_module_names(model)
    out = {}
    for raw_name, _ in nn.Module.named_parameters(model, remove_duplicate=False):
        owner, _, leaf = raw_name.rpartition(".")
        base = modules.get(owner, owner)
        out[raw_name] = f"{base}.{leaf}" if base else leaf
    return out


def _fqn_by_param_id(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> clean FQN (a shared parameter keeps its first name)."""
    names = param_fqns(model)
    by_id: dict[int, str] = {}
    for raw_name, param in nn.Module.named_parameters(model, remove_duplicate=False):
        by_id.setdefault(id(param), names[raw_name])
    return by_id


def dcp_param_keys(model: nn.Module) -> dict[str, str]:
    """Key DCP's optimizer helpers use for a parameter -> clean FQN.

    DCP derives its keys from ``model.named_parameters()`` (which a wrapper class may
    already clean) through its FQN resolution; both spellings map to the clean FQN.
    """
    clean_by_id = _fqn_by_param_id(model)
    out = {}
    for name, param in model.named_parameters():
        for key in get_fqns(model, name):
            out[key] = clean_by_id.get(id(param), key)
    return out


def optimizer_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Clean FQNs of each param group's parameters, in the optimizer's order.

    ``ValueError`` if the optimizer holds a parameter that is not one of the model's.
    """
    by_id = _fqn_by_param_id(model)
    groups = []
    for group in optimizer.param_groups:
        try:
            groups.append([by_id[id(p)] for p in group["params"]])
        except KeyError:
            raise ValueError(
                "optimizer holds a parameter that is not a parameter of the model"
            ) from None
    return groups


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    return any(bool(s) for s in optimizer.state.values())


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside its dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def to_cpu(obj: Any) -> Any:
    """Copy every tensor in a nested structure to CPU (DTensors become plain tensors only
    if they already are; sharding is kept)."""
    return map_tensors(obj, lambda t: t.cpu())


def gather_values(obj: Any, *, cpu_offload: bool, keep: bool) -> Any:
    """``obj`` with every DTensor gathered into a full plain tensor (a collective: every
    rank calls this on the same structure), one tensor at a time in the structure's order.

    ``cpu_offload``: each full tensor (and each plain tensor) goes to the CPU right after
    its gather, so the device never holds more than one full tensor. ``keep=False`` (a
    nonzero rank under ``rank0_only``): the gathers happen and their results are dropped at
    once; the return value is then meaningless.
    """

    def gather(t: torch.Tensor) -> Any:
        if isinstance(t, DTensor):
            full = gather_full(t, to_cpu=cpu_offload and keep)
            return full if keep else None
        return t.cpu() if cpu_offload and keep else t

    return map_tensors(obj, gather)


def model_state(
    model: nn.Module, *, full: bool = False, cpu_offload: bool = False, rank0_only: bool = False
) -> dict[str, Any]:
    """The model's state dict with clean FQN keys.

    ``full=False``: sharded ``DTensor`` values (no communication). ``full=True``: plain
    full tensors on every rank (``rank0_only``: on rank 0 only, ``{}`` elsewhere), gathered
    one tensor at a time on each mesh's communication device (:func:`gather_values`);
    ``cpu_offload`` moves the values to CPU, each right after its gather.
    """
    with raw_state_dict():
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    if not full:
        return to_cpu(sd) if cpu_offload else sd
    keep = not rank0_only or _rank() == 0
    sd = gather_values(sd, cpu_offload=cpu_offload, keep=keep)
    return sd if keep else {}


def optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    full: bool = False,
    cpu_offload: bool = False,
    rank0_only: bool = False,
) -> dict[str, Any]:
    """``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``.

    Parameters without optimizer state yet are absent from ``"state"``. Values follow
    ``full`` / ``cpu_offload`` / ``rank0_only`` like :func:`model_state`.
    """
    if not _has_state(optimizer):
        groups = optimizer_param_groups(model, optimizer)
        param_groups = []
        for group, names in zip(optimizer.state_dict()["param_groups"], groups, strict=True):
            param_groups.append({**group, "params": list(names)})
        if full and rank0_only and _rank() != 0:
            return {}
        return {"state": {}, "param_groups": param_groups}
    with raw_state_dict():
        osd = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=False)
        )
    names = dcp_param_keys(model)
    osd = {
        "state": {names.get(k, k): v for k, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [names.get(p, p) for p in g["params"]]} for g in osd["param_groups"]
        ],
    }
    if not full:
        return to_cpu(osd) if cpu_offload else osd
    keep = not rank0_only or _rank() == 0
    osd = gather_values(osd, cpu_offload=cpu_offload, keep=keep)
    if not keep:
        return {}
    return _detach_from(osd, _live_storages(optimizer))


def _live_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    ptrs = set()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                ptrs.add(local.untyped_storage().data_ptr())
    return ptrs


def _detach_from(obj: Any, live: set[int]) -> Any:
    """Clone the tensors that still share storage with live optimizer state (e.g. Adam's
    scalar ``step``, which a later ``step()`` increments in place)."""

    def copy_if_live(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor) and t.untyped_storage().data_ptr() in live:
            return t.detach().clone()
        return t

    return map_tensors(obj, copy_if_live)


def apply_model_state(
    model: nn.Module, state: dict[str, Any], *, strict: bool = True, full: bool = False
) -> Any:
    """Load ``state`` (clean FQN keys; DTensor or, with ``full``, plain full tensors)."""
    with raw_state_dict():
        return set_model_state_dict(
            model, state, options=StateDictOptions(strict=strict, full_state_dict=full)
        )


def apply_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    full: bool = False,
) -> None:
    """Load an optimizer state dict keyed by clean FQNs (as :func:`optimizer_state` makes)."""
    if not full and not _has_torch_fsdp1(model):
        _load_sharded(model, optimizer, state)
        return
    inverse = {clean: key for key, clean in dcp_param_keys(model).items()}
    raw_state = {
        "state": {inverse.get(k, k): v for k, v in state.get("state", {}).items()},
        "param_groups": [
            {**g, "params": [inverse.get(p, p) for p in g["params"]]}
            for g in state.get("param_groups", [])
        ],
    }
    # strict=False: parameters without optimizer state yet are legitimate (torch's
    # optimizers create state lazily); parameter groups are checked by the callers.
    with raw_state_dict():
        set_optimizer_state_dict(
            model,
            optimizer,
            raw_state,
            options=StateDictOptions(full_state_dict=full, strict=False),
        )


def _has_torch_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP1

    return any(isinstance(m, TorchFSDP1) for m in model.modules())


def _load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Sharded optimizer state into ``optimizer``, as ``set_optimizer_state_dict`` loads it
    for a model without torch FSDP1 modules (torch 2.9 to 2.14: each of the optimizer's
    groups takes the hyperparameters of the saved group holding its first parameter, and
    the state of its parameters that require grad, then ``Optimizer.load_state_dict``),
    without the zero-gradient ``step()`` it first takes on an optimizer without state."""
    saved_state = state.get("state", {})
    saved_groups = state.get("param_groups", [])
    loaded: dict[str, Any] = {"state": {}, "param_groups": []}
    for group, names in zip(
        optimizer.param_groups, optimizer_param_groups(model, optimizer), strict=True
    ):
        saved = next(
            (g for g in saved_groups if (names[0] in g["params"] if names else not g["params"])),
            group,
        )
        loaded["param_groups"].append(
            {**{k: v for k, v in saved.items() if k != "params"}, "params": names}
        )
        for name, param in zip(names, group["params"], strict=True):
            if param.requires_grad and name in saved_state:
                loaded["state"][name] = saved_state[name]
    optimizer.load_state_dict(loaded)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
