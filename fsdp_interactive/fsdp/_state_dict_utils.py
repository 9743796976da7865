"""FSDP1's state-dict types on ``fully_shard`` modules: settings and ``state_dict`` hooks.

Settings (:func:`set_state_dict_type`, :func:`get_state_dict_type`,
:func:`state_dict_type`) are stored on every ``FSDPModule`` under the given module, with
torch FSDP1's checks and per-type default configs. They work on a raw ``fully_shard``
model as well as on ``FullyShardedDataParallel``. Default type: FULL_STATE_DICT for
``FullyShardedDataParallel`` (FSDP1's default); SHARDED_STATE_DICT for a raw
``fully_shard`` model, whose ``state_dict()`` natively returns DTensors and keeps doing so
until a type is set.

:func:`install_state_dict_hooks` makes ``module.state_dict()`` / ``load_state_dict()``
follow the active type:

* ``FULL_STATE_DICT``: full plain tensors (gathered on the mesh's communication device
  with :func:`~._comm_device.gather_full`, a collective: every rank calls
  ``state_dict()``); ``rank0_only`` leaves ``{}`` on nonzero ranks; ``offload_to_cpu``
  moves each value to CPU right after its gather, so the device holds one full tensor at
  a time (FSDP1 streams unit by unit). Loading accepts full tensors on every rank and
  keeps only this rank's shard (no communication).
* ``SHARDED_STATE_DICT``: ``DTensor`` values (FSDP2's native state dict). torch FSDP1
  returns ``ShardedTensor`` unless ``_use_dtensor`` is set; here it is always ``DTensor``.
  Loading accepts ``DTensor``, full tensors and torch's ``ShardedTensor`` (FSDP1's own
  sharded values), resharded to each parameter's layout (:mod:`._sharded_tensor`; a
  collective, as FSDP1's sharded load is).
* ``LOCAL_STATE_DICT``: this rank's local shard of each parameter as a plain tensor,
  under the parameter's own key. torch FSDP1 instead returns one flattened, padded
  ``_flat_param`` ``ShardedTensor`` per FSDP unit (plus per-parameter views); FSDP2 has no
  flat parameter, so the per-parameter ``Shard(0)`` chunks (``torch.chunk`` layout, empty
  on trailing ranks when the dim is short) are what a rank owns. Loading rebuilds the
  ``DTensor`` from the local chunk; a LOCAL state dict loads only at the same world
  size and wrapping.

Keys never contain a wrapper's inner-module segment: modules exposing
``_fqn_modifiers()`` get hooks that drop the listed child names on save and put them back
on load (also in the missing/unexpected key lists of ``load_state_dict``).
Not done: ShardedTensor output; NO_SHARD-specific behaviour (FSDP1 returns full tensors
for NO_SHARD under every type; here values follow the DTensor placement).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import FQN_MODIFIERS_METHOD, buffer_slots, parameter_slots
from fsdp_interactive.fsdp._comm_device import gather_full
from fsdp_interactive.fsdp._raw_state_dict import hooks_suspended
from fsdp_interactive.fsdp._sharded_tensor import (
    is_sharded_tensor,
    local_as_dtensor_like,
    piece_as_dtensor_like,
    to_dtensor_like,
)
from fsdp_interactive.fsdp.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

_SETTINGS = "_fsdpi_state_dict_settings"
_HOOKED = "_fsdpi_state_dict_hooks"
_PREFIX_HOOKED = "_fsdpi_prefix_hooks"

_CONFIG_FOR = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


def default_settings() -> StateDictSettings:
    """FSDP1's default: FULL_STATE_DICT with default full configs."""
    return StateDictSettings(
        StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
    )


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """Every ``fully_shard``-ed module under ``module`` (itself included), pre-order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def native_settings() -> StateDictSettings:
    """What a raw ``fully_shard`` module's ``state_dict()`` returns: DTensor shards."""
    return StateDictSettings(
        StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
    )


def settings_of(unit: nn.Module) -> StateDictSettings:
    """A unit's settings: set explicitly, else FSDP1's FULL default for units built by
    ``FullyShardedDataParallel`` (see :func:`install_state_dict_hooks`), else the native
    SHARDED behaviour of a raw ``fully_shard`` module."""
    return getattr(unit, _SETTINGS, None) or native_settings()


def has_chosen_type(module: nn.Module) -> bool:
    """Whether the FSDP units under ``module`` have a state-dict type set (by
    :func:`set_state_dict_type` or FSDP1's default at construction) rather than the native
    behaviour of a raw ``fully_shard`` model."""
    return any(getattr(unit, _SETTINGS, None) is not None for unit in fsdp_units(module))


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Set the state-dict type of every FSDP unit under ``module``; the previous settings.

    Same checks as torch FSDP1: a config of the wrong class raises ``RuntimeError``
    ("Expected state_dict_config of type ..."); units that disagree raise
    ``AssertionError``. Installs the ``state_dict`` hooks if not yet installed. Unlike
    torch, no deprecation ``FutureWarning`` is emitted: this API is this package's
    supported way to choose a state-dict format.
    """
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(
            f"state_dict_type must be a StateDictType, got {type(state_dict_type).__name__}"
        )
    config_type, optim_config_type = _CONFIG_FOR[state_dict_type]
    if state_dict_config is None:
        state_dict_config = config_type()
    if optim_state_dict_config is None:
        optim_state_dict_config = optim_config_type()
    if type(state_dict_config) is not config_type:
        raise RuntimeError(
            f"Expected state_dict_config of type {config_type} but got {type(state_dict_config)}"
        )
    if type(optim_state_dict_config) is not optim_config_type:
        raise RuntimeError(
            f"Expected optim_state_dict_config of type {optim_config_type} "
            f"but got {type(optim_state_dict_config)}"
        )
    units = fsdp_units(module)
    previous: StateDictSettings | None = None
    for unit in units:
        current = settings_of(unit)
        if previous is None:
            previous = current
        elif previous.state_dict_type != current.state_dict_type:
            raise AssertionError("All FSDP modules should have the same state_dict_type.")
    new = StateDictSettings(state_dict_type, state_dict_config, optim_state_dict_config)
    for unit in units:
        setattr(unit, _SETTINGS, new)
    install_state_dict_hooks(module)
    if previous is None:
        return StateDictSettings(None, None, None)  # type: ignore[arg-type]
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings | None:
    """The settings shared by every FSDP unit under ``module`` (``None`` if it has none).

    ``AssertionError`` if units differ (torch FSDP1's contract).
    """
    found: StateDictSettings | None = None
    for unit in fsdp_units(module):
        current = settings_of(unit)
        if found is None:
            found = current
        elif found != current:
            raise AssertionError(
                "All FSDP modules must have the same state dict settings."
                f"Got {current} and {found}."
            )
    return found


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Iterator[None]:
    """Context manager: set the state-dict type, restore the previous settings on exit."""
    previous = set_state_dict_type(
        module, state_dict_type, state_dict_config, optim_state_dict_config
    )
    try:
        yield
    finally:
        if previous.state_dict_type is not None:
            set_state_dict_type(
                module,
                previous.state_dict_type,
                previous.state_dict_config,
                previous.optim_state_dict_config,
            )


# ----------------------------------------------------------------------------- hooks


def install_state_dict_hooks(module: nn.Module, *, fsdp1_default: bool = True) -> None:
    """Make ``state_dict``/``load_state_dict`` of ``module`` follow the active type.

    Idempotent. Registers, in this order, on every module with ``_fqn_modifiers`` the
    prefix hooks and on every FSDP unit the value hooks. ``fsdp1_default`` gives units
    without settings FSDP1's default (FULL_STATE_DICT): ``FullyShardedDataParallel``
    calls this at construction. Raw ``fully_shard`` units get hooks only through
    :func:`set_state_dict_type`, which sets their type explicitly first.
    """
    if fsdp1_default:
        for unit in fsdp_units(module):
            if getattr(unit, _SETTINGS, None) is None:
                setattr(unit, _SETTINGS, default_settings())
    for sub in module.modules():
        modifiers = getattr(sub, FQN_MODIFIERS_METHOD, None)
        if callable(modifiers) and not getattr(sub, _PREFIX_HOOKED, False):
            sub.register_load_state_dict_pre_hook(_add_hidden_prefix)
            sub.register_load_state_dict_post_hook(_clean_incompatible_keys)
            setattr(sub, _PREFIX_HOOKED, True)
        if isinstance(sub, FSDPModule) and not getattr(sub, _HOOKED, False):
            sub.register_state_dict_post_hook(_convert_on_save)
            sub.register_load_state_dict_pre_hook(_convert_on_load)
            setattr(sub, _HOOKED, True)
    # Prefix stripping on save must run after the units' value hooks: register last.
    for sub in module.modules():
        modifiers = getattr(sub, FQN_MODIFIERS_METHOD, None)
        if callable(modifiers) and getattr(sub, _PREFIX_HOOKED, False) is True:
            sub.register_state_dict_post_hook(_strip_hidden_prefix)
            setattr(sub, _PREFIX_HOOKED, "both")


def _hidden(module: nn.Module) -> list[str]:
    return sorted(set(getattr(module, FQN_MODIFIERS_METHOD)().values()))


def _strip_hidden_prefix(module: nn.Module, state_dict: dict, prefix: str, _meta: Any) -> None:
    for hidden in _hidden(module):
        inner = f"{prefix}{hidden}."
        for key in [k for k in state_dict if k.startswith(inner)]:
            state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


_renames = threading.local()


def _add_hidden_prefix(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    hidden = _hidden(module)
    if len(hidden) != 1:
        return
    inner = f"{prefix}{hidden[0]}."
    own = {f"{prefix}{n}" for n in parameter_slots(module)}
    own |= {f"{prefix}{n}" for n in buffer_slots(module)}
    renames = getattr(_renames, "map", None)
    if renames is None:
        renames = _renames.map = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key.startswith(inner) or key in own:
            continue
        new = inner + key[len(prefix) :]
        state_dict[new] = state_dict.pop(key)
        renames[new] = key
    for name in _raw_state_keys(module):
        full = f"{prefix}{name}"
        if full.startswith(inner):
            renames.setdefault(full, prefix + full[len(inner) :])


def _raw_state_keys(module: nn.Module) -> list[str]:
    # nn.Module's own traversal: raw names even where a class cleans its names.
    names = [n for n, _ in nn.Module.named_parameters(module)]
    names += [n for n, _ in nn.Module.named_buffers(module)]
    return names


def _clean_incompatible_keys(module: nn.Module, incompatible: Any) -> None:
    renames = getattr(_renames, "map", None) or {}
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        for i, key in enumerate(keys):
            keys[i] = renames.get(key, key)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _convert_on_save(module: nn.Module, state_dict: dict, prefix: str, _meta: Any) -> None:
    if hooks_suspended():
        return
    settings = settings_of(module)
    kind, config = settings.state_dict_type, settings.state_dict_config
    keys = [k for k in state_dict if k.startswith(prefix)]
    if kind == StateDictType.FULL_STATE_DICT:
        keep = not (config.rank0_only and _rank() != 0)
        for key in keys:
            value = state_dict[key]
            if isinstance(value, DTensor):
                # One tensor at a time, moved to CPU before the next gather (offload_to_cpu):
                # the device holds one full tensor at most, never the unit's or the model's.
                full = gather_full(value, to_cpu=config.offload_to_cpu and keep)
                state_dict[key] = full if keep else None
                del full
            elif keep and config.offload_to_cpu and isinstance(value, torch.Tensor):
                state_dict[key] = value.cpu()
        if not keep:
            for key in keys:
                del state_dict[key]
        return
    for key in keys:
        value = state_dict[key]
        if kind == StateDictType.LOCAL_STATE_DICT and isinstance(value, DTensor):
            value = state_dict[key] = value.to_local().detach()
        if config.offload_to_cpu and isinstance(value, torch.Tensor):
            state_dict[key] = value.cpu()


def _convert_on_load(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    if hooks_suspended():
        return
    kind = settings_of(module).state_dict_type
    # Every name of a shared parameter (tied embeddings) has its own key to convert.
    for name, param in nn.Module.named_parameters(module, remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(param, DTensor) or value is None or isinstance(value, DTensor):
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if is_sharded_tensor(value):
            state_dict[key] = to_dtensor_like(value, param)
        elif kind == StateDictType.LOCAL_STATE_DICT:
            state_dict[key] = local_as_dtensor_like(value, param)
        elif tuple(value.shape) == tuple(param.shape):
            state_dict[key] = piece_as_dtensor_like(value, param, dtype=param.dtype)
