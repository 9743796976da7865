"""``FullyShardedDataParallel``: torch FSDP1's public API on ``fully_shard`` (FSDP2).

A ``FullyShardedDataParallel`` instance (a *unit*) holds the user's module as
``_fsdp_wrapped_module`` (also ``.module``) and applies ``fully_shard`` to it, so every
parameter the unit owns becomes a DTensor sharded on dim 0 over the unit's mesh. With an
``auto_wrap_policy`` the chosen submodules become nested units first (bottom-up), the root
last. Attribute access and indexing fall through to the wrapped module.

What differs from torch's FSDP1 (and why):

* Parameters are the original parameters as sharded DTensors, never flat parameters
  (``fully_shard`` has none); passing ``use_orig_params=False`` warns once (leaving it at
  FSDP1's default does not).
* ``named_parameters()`` / ``named_buffers()`` on a unit always yield clean names (no
  ``_fsdp_wrapped_module.``), outside ``summon_full_params`` too. FSDP1 cleans them only
  inside ``summon_full_params``; torch's checkpoint helpers special-case FSDP1's class to clean
  keys, and clean names here give the same optimizer-state keys and name-based parameter
  groups as the unwrapped model. ``named_modules()`` keeps the wrapper level.
* Which unit is the root is structural: a unit is a root unless a unit above it was built
  around it (FSDP1 decides at the first forward).
* Forward inside ``summon_full_params`` raises ``RuntimeError``. Between a forward and its
  backward units are idle, so ``summon_full_params`` there is allowed (as in FSDP1).
* Without ``device_id`` the compute device is the accelerator the module's parameters are
  on; a CPU or meta module computes where its process group communicates: the current
  CUDA device over NCCL (as FSDP1), the CPU over gloo (FSDP1 requires an accelerator or
  an explicit CPU ``device_id``). See :func:`._init.resolve_device`.
* ``FULL_SHARD``/``HYBRID_SHARD`` units free parameters after forward except the root, which
  keeps them for backward, as FSDP1 does (``reshard_after_forward=None`` in ``fully_shard``).
  A unit around a module without ``forward`` (``nn.ModuleList``) has its parameters gathered
  by the forward of the unit above it (:mod:`._forwardless`); FSDP1 cannot compute with them.
* ``limit_all_gathers=False``, ``BACKWARD_POST`` and ``keep_low_precision_grads`` warn once
  and run as described in :mod:`._config`.

This module is the public entry point: the constructor checks and resolves its arguments
and builds the units (:mod:`._build`); every method delegates to the layer that implements
it (:mod:`._forward`, :mod:`._summon_full_params`, :mod:`._clip_grad`, :mod:`._comm_hooks`, and for
state dicts and optimizer state dicts :mod:`._state_dict_utils`, :mod:`._optim_utils`). Per
unit state lives in :class:`._unit_state.UnitState`, found with ``unit_state(module)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)

from fsdp_interactive._torch_compat import (
    CHECKPOINT_WRAPPED_MODULE,
    EXTRA_STATE_KEY_SUFFIX,
    ActivationWrapper,
    Policy,
    buffer_slots,
    move_own_states,
    parameter_slots,
    submodule_slots,
)
from fsdp_interactive.fsdp import _init, _optim_utils, _state_dict_utils, _summon_full_params
from fsdp_interactive.fsdp._build import setup_unit
from fsdp_interactive.fsdp._clip_grad import clip_grad_norm
from fsdp_interactive.fsdp._comm_hooks import register_comm_hook
from fsdp_interactive.fsdp._config import (
    UnitArgs,
    UnitConfig,
    Unpassed,
    config_for_module,
    passed_value,
    resolve_config,
    warn_unhonoured,
)
from fsdp_interactive.fsdp._forward import unit_forward
from fsdp_interactive.fsdp._rollback import TreeSnapshot
from fsdp_interactive.fsdp._traversal import check_idle, root_units, unit_states, units
from fsdp_interactive.fsdp._unit_state import IgnoredStates, UnitState, require_state
from fsdp_interactive.fsdp._validation import check_types, device_id_as_device, resolve_ignored
from fsdp_interactive.fsdp._wrapping import select_units, wrap_bottom_up

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
_PREFIX = FSDP_WRAPPED_MODULE + "."

# FSDP1's default (False), shown as such in the signature; an explicit False is told apart
# from it because only the explicit one warns.
_USE_ORIG_PARAMS_DEFAULT: Any = Unpassed(False)


def clean_name(name: str) -> str:
    """``name`` without ``_fsdp_wrapped_module.`` or ``_checkpoint_wrapped_module.`` components
    (the unwrapped model's name; FSDP1's ``clean_tensor_name`` drops the same two)."""
    return name.replace(_PREFIX, "").replace(CHECKPOINT_WRAPPED_MODULE + ".", "")


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters over ranks with ``fully_shard``; FSDP1's constructor.

    Arguments have FSDP1's names, order and defaults; see :mod:`._config` for how each maps
    onto ``fully_shard``. Every check on the arguments runs before the module is modified; if
    building fails part-way, the module (and its submodules) are restored as they were.
    """

    _fsdp_wrapped_module: nn.Module

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup
        | tuple[dist.ProcessGroup, dist.ProcessGroup]
        | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable | Policy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | str | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = _USE_ORIG_PARAMS_DEFAULT,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
    ):
        use_orig_params, use_orig_params_passed = passed_value(use_orig_params)
        check_types(
            module=module,
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            param_init_fn=param_init_fn,
            device_id=device_id,
            flags={
                "sync_module_states": sync_module_states,
                "forward_prefetch": forward_prefetch,
                "limit_all_gathers": limit_all_gathers,
                "use_orig_params": use_orig_params,
            },
            device_mesh=device_mesh,
        )
        device_id = device_id_as_device(device_id)
        if isinstance(module, FSDPModule):
            raise ValueError(
                "module already has fully_shard applied; pass the plain module instead"
            )
        super().__init__()
        ignored = resolve_ignored(module, ignored_modules, ignored_states)
        args = UnitArgs(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            device_mesh=device_mesh,
        )
        device = _init.resolve_device(
            device_id,
            module,
            ignored.params,
            process_group=process_group,
            device_mesh=device_mesh,
        )
        config = resolve_config(args, device)
        warn_unhonoured(args, use_orig_params_passed)
        snapshot = TreeSnapshot(module)
        try:
            if auto_wrap_policy is not None:
                targets = select_units(
                    module,
                    auto_wrap_policy,
                    ignored.modules,
                    ignored.params,
                    args.as_kwargs(),
                    mixed_precision,
                )
                wrap_bottom_up(
                    module,
                    targets,
                    lambda child, kwargs: FullyShardedDataParallel._unit_around(
                        child, config_for_module(config, kwargs), ignored
                    ),
                )
            if device_id is not None:
                for ignored_module in ignored.modules:
                    move_own_states(ignored_module, device)
            self._fsdp_wrapped_module = module
            setup_unit(self, module, config, ignored)
        except BaseException:
            snapshot.restore()
            raise
        for nested in unit_states(module):
            nested.has_parent = True

    @classmethod
    def _unit_around(
        cls, module: nn.Module, config: UnitConfig, ignored: IgnoredStates
    ) -> FullyShardedDataParallel:
        """A nested unit around ``module`` with an already-resolved config (auto-wrap)."""
        unit = cls.__new__(cls)
        nn.Module.__init__(unit)
        unit._fsdp_wrapped_module = module
        setup_unit(unit, module, config, ignored)
        return unit

    @property
    def _state(self) -> UnitState:
        return require_state(self)

    # ------------------------------------------------------------------ module shape

    @property
    def module(self) -> nn.Module:
        """The wrapped module (inside an activation-checkpoint wrapper, the module it wraps)."""
        inner = self._fsdp_wrapped_module
        if isinstance(inner, ActivationWrapper):
            return getattr(inner, CHECKPOINT_WRAPPED_MODULE)
        return inner

    def __getattr__(self, name: str) -> Any:
        """Fall through to the wrapped module for attributes the unit does not have."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = submodule_slots(self).get(FSDP_WRAPPED_MODULE)
            if inner is None:
                raise
            return getattr(inner, name)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (e.g. an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def _fqn_modifiers(self) -> dict[str, str]:
        """Tell torch's checkpoint helpers that this level does not appear in clean names.

        Maps each name directly under the wrapped module to ``_fsdp_wrapped_module``, the
        attribute to step through; used by ``torch.distributed.checkpoint.state_dict``.
        """
        inner = self._fsdp_wrapped_module
        names = [
            *submodule_slots(inner),
            *parameter_slots(inner),
            *buffer_slots(inner),
            EXTRA_STATE_KEY_SUFFIX,
        ]
        return dict.fromkeys(names, FSDP_WRAPPED_MODULE)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters`` with clean names (see the module docstring)."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield clean_name(name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers`` with clean names (see the module docstring)."""
        for name, buf in super().named_buffers(*args, **kwargs):
            yield clean_name(name), buf

    # ------------------------------------------------------------------ FSDP1 attributes

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._state.config.sharding_strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        """The unit's ``MixedPrecision`` (``MixedPrecision()``, all full precision, when none
        was passed, as in FSDP1)."""
        return self._state.config.mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._state.config.args.cpu_offload

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._state.config.args.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._state.config.args.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return self._state.config.args.limit_all_gathers

    @property
    def compute_device(self) -> torch.device:
        return self._state.config.device

    @property
    def device_mesh(self) -> DeviceMesh:
        """The unit's mesh: 1-D (shard) or 2-D (replicate, shard)."""
        return self._state.config.layout.mesh

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group this unit shards over (size 1 for NO_SHARD), as in FSDP1."""
        return self._state.config.layout.shard_group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def fsdp_module(self) -> FSDPModule:
        """The wrapped module as ``fully_shard`` left it (an ``FSDPModule``)."""
        return self._state.sharded_module

    # ------------------------------------------------------------------ FSDP1 methods

    def check_is_root(self) -> bool:
        """Whether no unit above this one was built around it."""
        return self._state.is_root

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """All units in ``module`` (itself included) in pre-order; ``root_only``: outermost."""
        return root_units(module) if root_only else units(module)  # type: ignore[return-value]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; the root casts inputs to ``param_dtype`` under mixed
        precision when ``cast_root_forward_inputs`` (FSDP1's default) is set."""
        return unit_forward(self, self._state, self._fsdp_wrapped_module, args, kwargs)

    summon_full_params = staticmethod(_summon_full_params.summon_full_params)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this unit's parameters whole; changes are written back.

        Nested units gather their own parameters when ``apply`` reaches them.
        """
        check_idle(self, "apply()")
        with _summon_full_params.summon_full_params(self, recurse=False, writeback=True):
            for child in self.children():
                child.apply(fn)
            fn(self)
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (no communication) inside the context.

        Root only. Gradients accumulate unsharded in every unit; the first backward after
        the context reduces the accumulated sum together with that backward's gradients.
        """
        if not self.check_is_root():
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call "
                "`no_sync()` on root FSDP module."
            )
        check_idle(self, "no_sync()")
        inner = self.fsdp_module
        inner.set_requires_gradient_sync(False, recurse=True)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True, recurse=True)

    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clip all gradients of the model to one global norm; returns the total norm.

        Root only. See :mod:`._clip_grad`.
        """
        if not self.check_is_root():
            raise RuntimeError(
                "`clip_grad_norm_()` should only be called on the root FSDP instance"
            )
        check_idle(self, "clip_grad_norm_()")
        return clip_grad_norm(self, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Route every unit's gradient reduction through ``hook`` (FSDP1's contract).

        See :mod:`._comm_hooks`.
        """
        register_comm_hook(self, state, hook)

    # ------------------------------------------------------------------ state-dict family
    # FSDP1's static methods, implemented (with FSDP1's signatures) by the state-dict layer.

    set_state_dict_type = staticmethod(_state_dict_utils.set_state_dict_type)
    get_state_dict_type = staticmethod(_state_dict_utils.get_state_dict_type)
    state_dict_type = staticmethod(_state_dict_utils.state_dict_type)
    optim_state_dict = staticmethod(_optim_utils.optim_state_dict)
    optim_state_dict_to_load = staticmethod(_optim_utils.optim_state_dict_to_load)
    full_optim_state_dict = staticmethod(_optim_utils.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(_optim_utils.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(_optim_utils.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(_optim_utils.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(_optim_utils.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(_optim_utils.rekey_optim_state_dict)
