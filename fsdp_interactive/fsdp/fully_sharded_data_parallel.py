"""``FullyShardedDataParallel``: torch FSDP1's public API on ``fully_shard`` (FSDP2).

A ``FullyShardedDataParallel`` instance (a *unit*) holds the user's module as
``_fsdp_wrapped_module`` (also ``.module``) and applies ``fully_shard`` to it, so every
parameter the unit owns becomes a DTensor sharded on dim 0 over the unit's mesh. With an
``auto_wrap_policy`` the chosen submodules become nested units first (bottom-up), the root
last. Attribute access and indexing fall through to the wrapped module.

What differs from torch's FSDP1 (and why):

* Parameters are the original parameters as sharded DTensors, never flat parameters
  (``fully_shard`` has none); ``use_orig_params=False`` warns once.
* ``named_parameters()`` / ``named_buffers()`` on a unit always yield clean names (no
  ``_fsdp_wrapped_module.``), outside ``summon_full_params`` too. FSDP1 cleans them only
  inside ``summon_full_params``; torch's checkpoint helpers special-case FSDP1's class to clean
  keys, and clean names here give the same optimizer-state keys and name-based parameter
  groups as the unwrapped model. ``named_modules()`` keeps the wrapper level.
* Which unit is the root is structural: a unit is a root unless a unit above it was built
  around it (FSDP1 decides at the first forward).
* Forward inside ``summon_full_params`` raises ``RuntimeError``. Between a forward and its
  backward units are idle, so ``summon_full_params`` there is allowed (as in FSDP1).
* Without ``device_id`` the compute device is where the module's parameters are, else CPU
  (FSDP1 requires an accelerator or an explicit CPU ``device_id``).
* ``FULL_SHARD``/``HYBRID_SHARD`` units free parameters after forward except the root, which
  keeps them for backward, as FSDP1 does (``reshard_after_forward=None`` in ``fully_shard``).
  Forward-less containers (``nn.ModuleList``/``ModuleDict``) never become units.
* ``limit_all_gathers=False``, ``BACKWARD_POST`` and ``keep_low_precision_grads`` warn once
  and run as described in :mod:`._config`.

State dicts and optimizer state dicts are a separate layer (:mod:`._state_dict_utils`,
:mod:`._optim_utils`); the methods of that family delegate to it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.fsdp.fully_sharded_data_parallel import OptimStateKeyType
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import (
    CHECKPOINT_WRAPPED_MODULE,
    EXTRA_STATE_KEY_SUFFIX,
    ActivationWrapper,
    WrapPolicy,
    apply_to_own_tensors,
    buffer_slots,
    parameter_slots,
    submodule_slots,
    training_state_name,
    tree_map,
)
from fsdp_interactive.fsdp import _init, _optim_utils, _state_dict_utils, _summon
from fsdp_interactive.fsdp._config import (
    UnitConfig,
    mixed_precision_policy,
    offload_policy,
    warn_unhonoured,
)
from fsdp_interactive.fsdp._mesh import ShardingLayout, resolve_layout
from fsdp_interactive.fsdp._rollback import TreeSnapshot
from fsdp_interactive.fsdp._traversal import is_unit, root_units, units
from fsdp_interactive.fsdp._validation import IgnoredStates, check_types, resolve_ignored
from fsdp_interactive.fsdp._wrapping import select_units, wrap_bottom_up

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
_PREFIX = FSDP_WRAPPED_MODULE + "."


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
        auto_wrap_policy: Callable | WrapPolicy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
    ):
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
        if isinstance(module, FSDPModule):
            raise ValueError(
                "module already has fully_shard applied; pass the plain module instead"
            )
        super().__init__()
        ignored = resolve_ignored(module, ignored_modules, ignored_states, is_unit)
        device = _init.resolve_device(device_id, module, ignored.params)
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        layout = resolve_layout(strategy, device.type, process_group, device_mesh)
        warn_unhonoured(mixed_precision, backward_prefetch, limit_all_gathers, use_orig_params)
        cpu_offload = cpu_offload or CPUOffload()
        config = UnitConfig(
            layout=layout,
            device=device,
            mixed_precision=mixed_precision,
            mp_policy=mixed_precision_policy(mixed_precision),
            cpu_offload=cpu_offload,
            offload_policy=offload_policy(cpu_offload),
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            param_init_fn=param_init_fn,
            sync_module_states=sync_module_states,
        )
        root_kwargs = {
            "process_group": process_group,
            "sharding_strategy": strategy,
            "cpu_offload": cpu_offload,
            "backward_prefetch": backward_prefetch,
            "mixed_precision": mixed_precision,
            "param_init_fn": param_init_fn,
            "device_id": device_id,
            "sync_module_states": sync_module_states,
            "forward_prefetch": forward_prefetch,
            "limit_all_gathers": limit_all_gathers,
            "use_orig_params": use_orig_params,
            "device_mesh": device_mesh,
        }
        snapshot = TreeSnapshot(module)
        try:
            if auto_wrap_policy is not None:
                targets = select_units(
                    module,
                    auto_wrap_policy,
                    ignored.modules,
                    ignored.params,
                    is_unit,
                    root_kwargs,
                    mixed_precision,
                )

                def wrap_child(child: nn.Module, kwargs: dict[str, Any]) -> nn.Module:
                    child_config = _config_for_child(config, root_kwargs, kwargs, child)
                    return FullyShardedDataParallel._build_unit(child, child_config, ignored)

                wrap_bottom_up(module, targets, wrap_child, [])
            if device_id is not None:
                for ignored_module in ignored.modules:
                    apply_to_own_tensors(ignored_module, lambda t: t.to(device))
            self._setup_unit(module, config, ignored)
        except BaseException:
            snapshot.restore()
            raise
        for nested in units(module):
            nested._fsdp_has_parent = True

    # ------------------------------------------------------------------ construction

    @classmethod
    def _build_unit(
        cls, module: nn.Module, config: UnitConfig, ignored: IgnoredStates
    ) -> FullyShardedDataParallel:
        """A unit around ``module`` with an already-resolved config (used by auto-wrap)."""
        unit = cls.__new__(cls)
        nn.Module.__init__(unit)
        unit._setup_unit(module, config, ignored)
        return unit

    def _setup_unit(self, module: nn.Module, config: UnitConfig, ignored: IgnoredStates) -> None:
        self._fsdp_wrapped_module = module
        # Not registered as a child: the same module under a second name. The wrapped module
        # may later be wrapped itself (activation checkpointing); this stays the FSDPModule.
        self.__dict__["_fsdp_sharded_module"] = module
        self._fsdp_config = config
        self._fsdp_ignored = ignored
        self._fsdp_has_parent = False
        self._fsdp_summoning = False
        self._fsdp_forward_depth = 0
        self._fsdp_forward_order: list[FullyShardedDataParallel] | None = None
        self._comm_hook: Callable | None = None
        self._comm_hook_state: object = None
        self._comm_hook_runner: object = None
        self._buffer_original_dtypes: dict[tuple[nn.Module, str], torch.dtype] = {}

        owned = _init.unit_modules(module, is_unit, ignored.modules)
        materialized = _init.has_meta_states(owned, ignored.params)
        if materialized:
            _init.materialize(owned, config.param_init_fn, config.device, ignored.params)
        if config.sync_module_states:
            _init.broadcast_from_rank0(owned, ignored.params, config.layout.mesh)
        self._cast_buffers(owned)
        ignored_here = {p for p in module.parameters() if p in ignored.params}
        fully_shard(
            module,
            mesh=config.layout.mesh,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=config.mp_policy,
            offload_policy=config.offload_policy,
            ignored_params=ignored_here or None,
        )
        if materialized:
            _init.release_freed_memory()  # the unit's full tensors, now sharded
        if config.backward_prefetch is None:
            # An explicit list disables fully_shard's implicit next-unit prefetch; prefetching
            # the unit itself is a no-op (it is already unsharded when its backward starts).
            module.set_modules_to_backward_prefetch([module])
        _state_dict_utils.install_state_dict_hooks(self)

    def _cast_buffers(self, owned: list[nn.Module]) -> None:
        mp = self._fsdp_config.mixed_precision
        if mp is None or mp.buffer_dtype is None:
            return
        for module in owned:
            if module in self._fsdp_ignored.modules:
                continue
            for name, buf in buffer_slots(module).items():
                if buf is None or not buf.is_floating_point() or buf.dtype == mp.buffer_dtype:
                    continue
                self._buffer_original_dtypes[(module, name)] = buf.dtype
                buffer_slots(module)[name] = buf.to(mp.buffer_dtype)

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

    # ------------------------------------------------------------------ helpers for other layers

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._fsdp_config.sharding_strategy

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        return self._fsdp_config.mixed_precision

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._fsdp_config.cpu_offload

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._fsdp_config.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._fsdp_config.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return self._fsdp_config.limit_all_gathers

    @property
    def compute_device(self) -> torch.device:
        return self._fsdp_config.device

    @property
    def device_mesh(self) -> DeviceMesh:
        """The unit's mesh: 1-D (shard) or 2-D (replicate, shard)."""
        return self._fsdp_config.layout.mesh

    @property
    def sharding_layout(self) -> ShardingLayout:
        return self._fsdp_config.layout

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group this unit shards over (size 1 for NO_SHARD), as in FSDP1."""
        return self._fsdp_config.layout.shard_group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def fsdp_module(self) -> FSDPModule:
        """The wrapped module as ``fully_shard`` left it (an ``FSDPModule``)."""
        return self.__dict__["_fsdp_sharded_module"]

    def owned_modules(self) -> list[nn.Module]:
        """Modules whose own parameters this unit shards (nested units and ignored excluded)."""
        return _init.unit_modules(self._fsdp_wrapped_module, is_unit, self._fsdp_ignored.modules)

    @property
    def ignored_parameters(self) -> frozenset[nn.Parameter]:
        return self._fsdp_ignored.params

    def buffer_original_dtypes(self) -> dict[str, torch.dtype]:
        """Clean names (relative to this unit) of buffers cast by ``buffer_dtype`` -> dtype.

        Covers this unit and all nested units.
        """
        out: dict[str, torch.dtype] = {}
        owner = {id(m): n for n, m in self.named_modules()}
        for unit in units(self):
            for (module, name), dtype in unit._buffer_original_dtypes.items():
                prefix = clean_name(owner[id(module)] + ".") if owner[id(module)] else ""
                out[prefix + name] = dtype
        return out

    def reshard_all(self) -> None:
        """Register sharded parameters on every unit (after a forward without backward)."""
        for unit in units(self):
            unit.fsdp_module.reshard()

    # ------------------------------------------------------------------ FSDP1 methods

    def check_is_root(self) -> bool:
        """Whether no unit above this one was built around it."""
        return not self._fsdp_has_parent

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """All units in ``module`` (itself included) in pre-order; ``root_only``: outermost."""
        return root_units(module) if root_only else units(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; the root casts inputs to ``param_dtype`` under mixed
        precision when ``cast_root_forward_inputs`` (FSDP1's default) is set."""
        if self._fsdp_summoning:
            raise RuntimeError(
                "forward() inside summon_full_params() is not supported: exit the context first"
            )
        mp = self._fsdp_config.mixed_precision
        root = self.check_is_root()
        if root and mp is not None and mp.param_dtype is not None and mp.cast_root_forward_inputs:
            args, kwargs = _cast_floating(mp.param_dtype, (args, kwargs))
        if root and self._fsdp_config.forward_prefetch:
            return self._forward_recording_order(*args, **kwargs)
        self._fsdp_forward_depth += 1
        try:
            return self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            self._fsdp_forward_depth -= 1

    def _forward_recording_order(self, *args: Any, **kwargs: Any) -> Any:
        """First forward: record unit order, then set each unit to prefetch the next one."""
        if self._fsdp_forward_order is not None:
            self._fsdp_forward_depth += 1
            try:
                return self._fsdp_wrapped_module(*args, **kwargs)
            finally:
                self._fsdp_forward_depth -= 1
        order: list[FullyShardedDataParallel] = []
        handles = [
            unit.fsdp_module.register_forward_pre_hook(
                lambda _m, _a, unit=unit: order.append(unit) if unit not in order else None
            )
            for unit in units(self)
        ]
        self._fsdp_forward_depth += 1
        try:
            out = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            self._fsdp_forward_depth -= 1
            for handle in handles:
                handle.remove()
        for current, following in itertools.pairwise(order):
            current.fsdp_module.set_modules_to_forward_prefetch([following.fsdp_module])
        self._fsdp_forward_order = order
        return out

    def _check_idle(self, what: str) -> None:
        for unit in units(self):
            if unit._fsdp_forward_depth or unit._fsdp_summoning:
                doing = "summon_full_params()" if unit._fsdp_summoning else "forward()"
                raise RuntimeError(f"{what} cannot be called during {doing}")
            state = training_state_name(unit.fsdp_module)
            if state != "IDLE":
                raise RuntimeError(
                    f"{what} cannot be called during forward or backward "
                    f"(a unit is in state {state})"
                )

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Generator[None, None, None]:
        """Expose whole parameters (original dtype) on the units of ``module``.

        ``recurse=False`` only gathers ``module``'s own unit. See :mod:`._summon` for what each
        flag does. Raises ``NotImplementedError`` (a ``RuntimeError``) for
        ``rank0_only=True`` with ``writeback=True`` and for ``with_grads=True`` with
        ``offload_to_cpu=True`` (as FSDP1), ``RuntimeError`` when called during forward,
        backward or another ``summon_full_params`` of the same units.
        """
        for name, value in (
            ("recurse", recurse),
            ("writeback", writeback),
            ("rank0_only", rank0_only),
            ("offload_to_cpu", offload_to_cpu),
            ("with_grads", with_grads),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if rank0_only and writeback:
            raise NotImplementedError(
                "summon_full_params: writeback=True and rank0_only=True is not supported "
                "(pass writeback=False)"
            )
        if with_grads and offload_to_cpu:
            raise NotImplementedError(
                "summon_full_params: with_grads=True and offload_to_cpu=True is not supported"
            )
        own_unit = [module] if is_unit(module) else []
        targets = units(module) if recurse else own_unit
        for unit in targets:
            unit._check_idle("summon_full_params()")
        for unit in targets:
            unit.fsdp_module.reshard()
        plan = [(unit.owned_modules(), unit.sharding_layout.shard_group) for unit in targets]
        for unit in targets:
            unit._fsdp_summoning = True
        try:
            with _summon.summon_units(
                plan,
                writeback=writeback,
                rank0_only=rank0_only,
                offload_to_cpu=offload_to_cpu,
                with_grads=with_grads,
            ):
                yield
        finally:
            for unit in targets:
                unit._fsdp_summoning = False

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this unit's parameters whole; changes are written back.

        Nested units gather their own parameters when ``apply`` reaches them.
        """
        self._check_idle("apply()")
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
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
                "no_sync() on inner FSDP units is not supported: call it on the root unit"
            )
        self._check_idle("no_sync()")
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
        from fsdp_interactive.fsdp._clip_grad import clip_grad_norm

        if not self.check_is_root():
            raise RuntimeError("clip_grad_norm_() should only be called on the root FSDP unit")
        self._check_idle("clip_grad_norm_()")
        return clip_grad_norm(self, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Route every unit's gradient reduction through ``hook`` (FSDP1's contract).

        See :mod:`._comm_hooks`.
        """
        from fsdp_interactive.fsdp._comm_hooks import register_comm_hook

        register_comm_hook(self, state, hook)

    # ------------------------------------------------------------------ state-dict family
    # Provided by the state-dict layer (._state_dict_utils, ._optim_utils); signatures are FSDP1's.

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        return _state_dict_utils.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        return _state_dict_utils.get_state_dict_type(module)  # type: ignore[return-value]

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Generator:
        with _state_dict_utils.state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        ):
            yield

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: list[dict[str, Any]] | Iterable[nn.Parameter] | None = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        return _optim_utils.full_optim_state_dict(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        return _optim_utils.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: list[dict[str, Any]] | Iterable[nn.Parameter] | None = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        return _optim_utils.shard_full_optim_state_dict(
            full_optim_state_dict, model, optim_input, optim
        )

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim: torch.optim.Optimizer,
    ) -> dict[str, Any]:
        return _optim_utils.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: list[dict[str, Any]] | Iterable[nn.Parameter] | None = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any | None = None,
    ) -> dict[str, Any]:
        return _optim_utils.scatter_full_optim_state_dict(
            full_optim_state_dict, model, optim_input, optim, group
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: list[dict[str, Any]] | Iterable[nn.Parameter] | None = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        return _optim_utils.rekey_optim_state_dict(
            optim_state_dict, optim_state_key_type, model, optim_input, optim
        )

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        return _optim_utils.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        return _optim_utils.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    # ------------------------------------------------------------------ end of state-dict family


def _cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.is_floating_point():
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def _config_for_child(
    config: UnitConfig,
    root_kwargs: dict[str, Any],
    kwargs: dict[str, Any],
    child: nn.Module,
) -> UnitConfig:
    """The root's config, or one resolved from a policy's per-module overrides."""
    overrides = {k: v for k, v in kwargs.items() if k in root_kwargs and v is not root_kwargs[k]}
    if not overrides:
        return config
    merged = {**root_kwargs, **overrides}
    strategy = merged["sharding_strategy"] or ShardingStrategy.FULL_SHARD
    layout = (
        config.layout
        if strategy == config.layout.strategy
        and merged["process_group"] is root_kwargs["process_group"]
        and merged["device_mesh"] is root_kwargs["device_mesh"]
        else resolve_layout(
            strategy, config.device.type, merged["process_group"], merged["device_mesh"]
        )
    )
    cpu_offload = merged["cpu_offload"] or CPUOffload()
    return UnitConfig(
        layout=layout,
        device=config.device,
        mixed_precision=merged["mixed_precision"],
        mp_policy=mixed_precision_policy(merged["mixed_precision"]),
        cpu_offload=cpu_offload,
        offload_policy=offload_policy(cpu_offload),
        backward_prefetch=merged["backward_prefetch"],
        forward_prefetch=merged["forward_prefetch"],
        limit_all_gathers=merged["limit_all_gathers"],
        use_orig_params=merged["use_orig_params"],
        param_init_fn=merged["param_init_fn"],
        sync_module_states=merged["sync_module_states"],
    )
