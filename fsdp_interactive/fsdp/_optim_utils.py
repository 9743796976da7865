"""FSDP1's optimizer-state-dict family on ``fully_shard`` modules.

All results are keyed like torch FSDP1's: by parameter FQN (clean: no wrapper segments)
for the "state dict" direction, by parameter ID (the position in the optimizer's
``state_dict()`` numbering) for the "to load" direction. Parameters without optimizer
state yet are absent from ``"state"``, except in the SHARDED/LOCAL state of an optimizer
that has not stepped at all, which holds placeholders a ``dcp.load`` can fill (see
:func:`optim_state_dict`).

Inputs of the "to load" direction may hold full tensors, ``DTensor`` values of any layout,
or torch's ``ShardedTensor`` (what torch FSDP1 and ``torch.distributed.checkpoint.
optimizer.load_sharded_optimizer_state_dict`` produce): each is resharded to the
parameter's own layout (:mod:`._sharded_tensor`). Converting ``ShardedTensor`` values
communicates, so every rank calls these functions with the same keys, as in FSDP1.

Differences from torch FSDP1, following from FSDP2 having no flat parameter:

* sharded values are ``DTensor`` (torch: ``ShardedTensor``), and the "to load" dicts hold
  ``DTensor`` shards of each original parameter (torch: 1-D slices of a flat parameter);
* ``group`` arguments are accepted and ignored: the parameters' meshes define the ranks;
* the ``optim_state_dict`` argument of :func:`optim_state_dict` is accepted for signature
  compatibility; the state is always read from ``optim`` itself.

The legacy functions (``full_``, ``sharded_``, ``shard_full_``, ``scatter_full_``,
``flatten_sharded_optim_state_dict``) emit the same kind of ``FutureWarning`` torch FSDP1
emits, pointing at ``optim_state_dict`` / ``optim_state_dict_to_load``, because they are
legacy in the FSDP1 API itself. They are kept, deprecated, for as long as torch keeps
them: torch's ``FullyShardedDataParallel`` still has all five (checked on 2.13, where
they warn the same way), FSDP1 training code and checkpoint recipes call them, and
dropping them here would make moving such code more than a change of one import. Each is
a few lines over the paths :func:`optim_state_dict` and :func:`optim_state_dict_to_load`
use. The conformance tests (``tests/fsdp/conformance/test_optim_state.py``) run them on
torch's class and on ours alike, so a torch release without them fails there: remove
them then.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._ranks import Ranks
from fsdp_interactive._torch_compat import local_tensor
from fsdp_interactive.fsdp import _fqn_state as _state
from fsdp_interactive.fsdp import _optim_placeholders
from fsdp_interactive.fsdp._comm_device import on_comm_device
from fsdp_interactive.fsdp._sharded_tensor import (
    is_sharded_tensor,
    local_as_dtensor_like,
    piece_as_dtensor_like,
    to_dtensor_like,
)
from fsdp_interactive.fsdp._state_broadcast import broadcast_from_rank0
from fsdp_interactive.fsdp._state_dict_utils import get_state_dict_type, has_chosen_type
from fsdp_interactive.fsdp.api import OptimStateKeyType, StateDictType

_CLASS = "FullyShardedDataParallel"


def _warn_legacy(curr: str, new: str) -> None:
    warnings.warn(
        f"``{_CLASS}.{curr}`` is deprecated (as in torch FSDP1) and is replaced by "
        f"``{_CLASS}.{new}``.",
        FutureWarning,
        stacklevel=3,
    )


def _param_order(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    optim_input: Iterable[Any] | None,
) -> list[nn.Parameter]:
    """Parameters in parameter-ID order: the optimizer's, else ``optim_input``'s, else the
    model's ``parameters()`` order (torch FSDP1's rule)."""
    if optim is not None:
        return list(chain.from_iterable(g["params"] for g in optim.param_groups))
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated; pass `optim` instead.",
            FutureWarning,
            stacklevel=3,
        )
        items = list(optim_input)
        if items and isinstance(items[0], dict):
            return list(chain.from_iterable(g["params"] for g in items))
        return items
    return list(model.parameters())


def _fqn_by_param(model: nn.Module) -> dict[int, str]:
    names = _state.param_fqns(model)
    out: dict[int, str] = {}
    for raw, param in nn.Module.named_parameters(model, remove_duplicate=False):
        out.setdefault(id(param), names[raw])
    return out


def _active_settings(model: nn.Module):
    from fsdp_interactive.fsdp._state_dict_utils import native_settings

    return get_state_dict_type(model) or native_settings()


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """The optimizer state keyed by parameter FQN, following ``get_state_dict_type(model)``.

    FULL_STATE_DICT: full tensors (``FullOptimStateDictConfig``: ``rank0_only`` -> ``{}``
    on nonzero ranks; ``offload_to_cpu``, default True, -> CPU). SHARDED and LOCAL:
    ``DTensor`` shards (torch FSDP1 gives ``ShardedTensor`` for both).

    An optimizer that has not stepped yet has no state. Under FULL_STATE_DICT, and for a raw
    ``fully_shard`` model whose type was never set, the result then has none either
    (``"state": {}``, as in torch FSDP1). Under a SHARDED or LOCAL type set with
    :func:`~._state_dict_utils.state_dict_type` (the DCP recipes' way) it holds placeholders: the tensors the optimizer's first step would create, so that
    ``dcp.load`` into this dict fills them and :func:`optim_state_dict_to_load` restores the
    checkpoint's state, where torch FSDP1 silently leaves the optimizer fresh. ``optim``
    itself stays fresh. Placeholders nothing wrote into are dropped again by
    :func:`optim_state_dict_to_load`. See :mod:`._optim_placeholders` for the values saved
    from a never-stepped optimizer.
    """
    settings = _active_settings(model)
    config = settings.optim_state_dict_config
    if settings.state_dict_type == StateDictType.FULL_STATE_DICT:
        return _state.optimizer_state(
            model,
            optim,
            full=True,
            cpu_offload=config.offload_to_cpu,
            rank0_only=getattr(config, "rank0_only", False),
        )
    return _sharded_optimizer_state(
        model,
        optim,
        cpu_offload=config.offload_to_cpu,
        placeholders=has_chosen_type(model),
    )


def _sharded_optimizer_state(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    cpu_offload: bool = False,
    placeholders: bool = True,
) -> dict[str, Any]:
    """DTensor optimizer state by FQN; with ``placeholders``, placeholders for a fresh
    ``optim`` (see :func:`optim_state_dict`)."""
    if not placeholders or _optim_placeholders.has_state(optim):
        return _state.optimizer_state(model, optim, full=False, cpu_offload=cpu_offload)
    _optim_placeholders.allocate(optim)
    try:
        osd = _state.optimizer_state(model, optim, full=False, cpu_offload=cpu_offload)
    finally:
        _optim_placeholders.clear(optim)
    _optim_placeholders.remember(osd["state"])
    return osd


def _to_param_value(value: Any, param: nn.Parameter) -> Any:
    """``value`` in ``param``'s layout, where it is a tensor of ``param``'s shape: this
    rank's piece as a DTensor on the parameter's device, never a view of a full tensor
    (which can then be freed). Other values come back as they are, tensors among them
    copied: the result never shares memory with ``value``, which may be another
    optimizer's live state (an optimizer's ``load_state_dict`` keeps the tensors it is
    given, and steps update them in place)."""
    converted = _in_param_layout(value, param)
    if isinstance(converted, torch.Tensor) and _shares_memory(converted, value):
        return converted.detach().clone()
    return converted


def _in_param_layout(value: Any, param: nn.Parameter) -> Any:
    if not isinstance(value, torch.Tensor) or not isinstance(param, DTensor):
        return value
    if is_sharded_tensor(value):
        return to_dtensor_like(value, param)
    if isinstance(value, DTensor):
        if value.device_mesh == param.device_mesh and value.placements == param.placements:
            return value
        # A collective over the mesh: on its communication device, whatever the shards' device.
        moved = on_comm_device(value).redistribute(param.device_mesh, param.placements)
        return local_as_dtensor_like(local_tensor(moved).to(param.device, copy=True), param)
    if tuple(value.shape) != tuple(param.shape):
        return value  # e.g. Adam's scalar ``step``
    return piece_as_dtensor_like(value, param)


def _storages(value: Any) -> set[int]:
    """Data pointers of the memory ``value`` holds on this rank (tensor, DTensor shard,
    ShardedTensor shards)."""
    if is_sharded_tensor(value):
        tensors = [shard.tensor for shard in value.local_shards()]
    elif isinstance(value, torch.Tensor):
        tensors = [local_tensor(value)]
    else:
        return set()
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel() > 0}


def _shares_memory(a: Any, b: Any) -> bool:
    return bool(_storages(a) & _storages(b))


def _from_rank0(model: nn.Module, osd: Any) -> Any:
    """Rank 0's full optimizer state (keyed by FQN) on every rank, streamed tensor by tensor
    (:func:`~._state_broadcast.broadcast_from_rank0`): each parameter-shaped value becomes
    this rank's piece as soon as it arrives, every other tensor a CPU copy, so neither the
    device nor this rank's memory ever holds the whole state."""
    fqn_of = _fqn_by_param(model)
    param_by_fqn = {fqn_of[id(p)]: p for p in model.parameters() if id(p) in fqn_of}

    def receive(path: tuple, tensor: torch.Tensor) -> Any:
        param = param_by_fqn.get(path[1]) if len(path) == 3 and path[0] == "state" else None
        if isinstance(param, DTensor):
            value = _to_param_value(tensor, param)
            if isinstance(value, DTensor):
                return value
        return tensor.to("cpu", copy=True)

    return broadcast_from_rank0(osd, receive=receive)


def _loadable(
    model: nn.Module,
    osd: dict[str, Any],
    order: list[nn.Parameter],
    optim: torch.optim.Optimizer | None,
    *,
    keep_names: bool = False,
) -> dict[str, Any]:
    """FQN-keyed (full or sharded) state -> this rank's ``optim.load_state_dict`` input."""
    if not isinstance(osd, dict) or "state" not in osd:
        raise ValueError(
            "optim_state_dict must be a dict with 'state' and 'param_groups', "
            f"got {type(osd).__name__} with keys {sorted(osd) if isinstance(osd, dict) else '-'}"
        )
    fqn_of = _fqn_by_param(model)
    param_by_fqn = {fqn_of[id(p)]: p for p in order if id(p) in fqn_of}
    pid_of = {fqn_of[id(p)]: i for i, p in enumerate(order) if id(p) in fqn_of}
    state: dict[Any, Any] = {}
    for key, entry in osd["state"].items():
        if key not in param_by_fqn:
            raise ValueError(
                f"optim_state_dict names parameter {key!r}, which is not an optimized "
                f"parameter of the model (known: {sorted(param_by_fqn)})"
            )
        if _optim_placeholders.unfilled(entry):
            continue  # a fresh optimizer's placeholders that no load wrote into
        param = param_by_fqn[key]
        value = {name: _to_param_value(v, param) for name, v in entry.items()}
        state[key if keep_names else pid_of[key]] = value
    groups_in = osd.get("param_groups", [])
    if optim is None:
        groups = [
            {**g, "params": [g_key if keep_names else pid_of[g_key] for g_key in g["params"]]}
            for g in groups_in
        ]
        return {"state": state, "param_groups": groups}
    groups = []
    by_set = {frozenset(g["params"]): g for g in groups_in}
    for current in optim.param_groups:
        names = [fqn_of[id(p)] for p in current["params"]]
        saved = by_set.get(frozenset(names))
        if saved is None:
            raise ValueError(
                f"no parameter group in optim_state_dict matches the optimizer group {names}; "
                f"saved groups: {[list(g['params']) for g in groups_in]}"
            )
        groups.append({**saved, "params": [n if keep_names else pid_of[n] for n in names]})
    return {"state": state, "param_groups": groups}


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: Any = None,
) -> dict[str, Any]:
    """Turn an :func:`optim_state_dict` result into what ``optim.load_state_dict`` takes.

    With FULL_STATE_DICT and ``rank0_only=True`` only rank 0's input is used: it is
    broadcast to the other ranks (which may pass ``{}`` or ``None``) one tensor at a time
    on the group's communication device, each cut to this rank's piece on arrival (as
    FSDP1 does), so no rank holds the whole state. ``load_directly`` also loads it into
    ``optim``.
    """
    settings = _active_settings(model)
    config = settings.optim_state_dict_config
    if settings.state_dict_type == StateDictType.FULL_STATE_DICT and getattr(
        config, "rank0_only", False
    ):
        optim_state_dict = _from_rank0(model, optim_state_dict)
    order = _param_order(model, optim, None)
    result = _loadable(model, optim_state_dict, order, optim, keep_names=is_named_optimizer)
    if load_directly:
        optim.load_state_dict(result)
    return result


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Iterable[Any] | None = None,
    rank0_only: bool = True,
    group: Any = None,
) -> dict[str, Any]:
    """Legacy: full optimizer state keyed by FQN, on CPU; ``{}`` on nonzero ranks if
    ``rank0_only``."""
    _warn_legacy("full_optim_state_dict", "optim_state_dict")
    return _state.optimizer_state(model, optim, full=True, cpu_offload=True, rank0_only=rank0_only)


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
) -> dict[str, Any]:
    """Legacy: optimizer state keyed by FQN with ``DTensor`` shards (placeholders for a
    fresh ``optim``, as :func:`optim_state_dict` under SHARDED_STATE_DICT)."""
    _warn_legacy("sharded_optim_state_dict", "optim_state_dict")
    return _sharded_optimizer_state(model, optim)


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Legacy: this rank's loadable (parameter-ID keyed) shard of a full state; every rank
    passes the full state."""
    _warn_legacy("shard_full_optim_state_dict", "optim_state_dict_to_load")
    order = _param_order(model, optim, optim_input)
    return _loadable(model, full_optim_state_dict, order, optim)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """Legacy: rank 0 holds the full state (others pass ``None``); every rank gets its
    loadable shard. The state travels from rank 0 one tensor at a time, each cut to this
    rank's piece on arrival."""
    _warn_legacy("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    ranks = Ranks()
    if ranks.rank == 0 and full_optim_state_dict is None:
        raise ValueError("rank 0 must pass the full optimizer state dict, got None")
    full = _from_rank0(model, full_optim_state_dict if ranks.rank == 0 else None)
    order = _param_order(model, optim, optim_input)
    return _loadable(model, full, order, optim)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim: torch.optim.Optimizer,
) -> dict[str, Any]:
    """Legacy: a :func:`sharded_optim_state_dict` result -> loadable by ``optim``."""
    _warn_legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    order = _param_order(model, optim, None)
    return _loadable(model, sharded_optim_state_dict, order, optim)


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: Iterable[Any] | None = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Re-key ``optim_state_dict`` by parameter name (FQN) or by parameter ID.

    IDs follow ``optim``'s parameter order, else ``optim_input``'s, else
    ``model.parameters()`` (torch FSDP1's rule). Already in the target form: returned
    unchanged. Mixed key types raise ``ValueError("Invalid parameter keys ...")``.
    """
    if not isinstance(optim_state_key_type, OptimStateKeyType):
        raise TypeError(
            "optim_state_key_type must be OptimStateKeyType.PARAM_NAME or PARAM_ID, "
            f"got {optim_state_key_type!r}"
        )
    keys = list(optim_state_dict.get("state", {}))
    keys += list(chain.from_iterable(g["params"] for g in optim_state_dict.get("param_groups", [])))
    names = all(isinstance(k, str) for k in keys)
    ids = all(isinstance(k, int) for k in keys)
    if keys and not (names or ids):
        raise ValueError(f"Invalid parameter keys (mixed names and IDs): {keys}")
    if not keys:
        return optim_state_dict
    if (optim_state_key_type == OptimStateKeyType.PARAM_NAME and names) or (
        optim_state_key_type == OptimStateKeyType.PARAM_ID and ids
    ):
        return optim_state_dict
    order = _param_order(model, optim, optim_input)
    fqn_of = _fqn_by_param(model)
    id_to_name = {i: fqn_of[id(p)] for i, p in enumerate(order)}
    name_to_id = {n: i for i, n in id_to_name.items()}
    mapping: dict[Any, Any] = id_to_name if ids else name_to_id
    unknown = [k for k in keys if k not in mapping]
    if unknown:
        raise ValueError(f"Invalid parameter keys: {unknown} are not parameters of the model")
    return {
        "state": {mapping[k]: v for k, v in optim_state_dict["state"].items()},
        "param_groups": [
            {**g, "params": sorted(mapping[k] for k in g["params"])}
            for g in optim_state_dict.get("param_groups", [])
        ],
    }
