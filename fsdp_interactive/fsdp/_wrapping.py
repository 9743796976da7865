"""Auto-wrap: choose the submodules that become their own FSDP units, then wrap bottom-up.

Unit selection uses the policy's own rules, so a policy picks the same units here as in
FSDP1:

* a ``_Policy`` (``ModuleWrapPolicy``, ``CustomPolicy``) runs its ``_run_policy``;
* a plain callable ``(module, recurse, nonwrapped_numel) -> bool`` is evaluated the way FSDP1's
  recursive wrapper evaluates it: ``recurse=True`` asks whether to descend into a module,
  children are decided first, then ``recurse=False`` with the parameter count not already
  claimed by wrapped children decides the module itself.

Selection is a pure pass over the unmodified tree; wrapping then happens in post-order
(children before parents), each selected submodule being replaced in its parent by a
``FullyShardedDataParallel`` unit. The root is never selected here: the constructor wraps it
last. Ignored modules (and everything under them) are skipped; a module reachable from two
parents is wrapped once, at its first position. A tree that already holds FSDP units (or
``fully_shard`` modules) is refused with FSDP1's ``ValueError``, before anything changes.

A selected module without a ``forward`` is made a unit as in FSDP1; the forward of the unit
above it gathers its parameters (:mod:`._forwardless`). ``nn.ModuleList`` and
``nn.ModuleDict`` without a ``forward`` (``always_wrap_policy`` selects them) are the
exception: ``fully_shard`` refuses them, so they stay inside the unit above them
(:func:`._forwardless.can_be_unit`); their children are still considered.

Under ``mixed_precision``, modules of ``MixedPrecision._module_classes_to_ignore`` (batch norm
by default) become their own units without mixed precision, with torch's own hooks casting
their inputs to float32 and their outputs back, exactly as FSDP1's auto-wrap does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.api import MixedPrecision

from fsdp_interactive._torch_compat import (
    Policy,
    module_classes_without_mixed_precision,
    or_policy,
    override_module_mixed_precision,
    run_mixed_precision_override_policy,
    run_policy,
    submodule_slots,
    warn_on_overridden_mixed_precision,
    wrap_module_cls_individually,
)
from fsdp_interactive.fsdp._forwardless import can_be_unit
from fsdp_interactive.fsdp._unit_state import is_unit

logger = logging.getLogger(__name__)

WrapFn = Callable[[nn.Module, dict[str, Any]], nn.Module]


def select_units(
    root: nn.Module,
    policy: Policy | Callable[..., bool],
    ignored_modules: frozenset[nn.Module],
    ignored_params: frozenset[nn.Parameter],
    root_kwargs: dict[str, Any],
    mixed_precision: MixedPrecision | None = None,
) -> dict[nn.Module, dict[str, Any]]:
    """Map every submodule (not the root) that should become a unit to its constructor kwargs.

    With ``mixed_precision``, also registers torch's float32 cast hooks on the modules of
    ``mixed_precision._module_classes_to_ignore`` (undone by the caller's rollback on failure).
    """
    check_not_wrapped(root)
    no_mp_classes = (
        module_classes_without_mixed_precision(mixed_precision) if mixed_precision else ()
    )
    if isinstance(policy, Policy):
        chosen = run_policy(policy, root, set(ignored_modules), dict(root_kwargs))
        if no_mp_classes:
            chosen = run_mixed_precision_override_policy(
                root, no_mp_classes, set(ignored_modules), dict(root_kwargs), chosen
            )
            warn_on_overridden_mixed_precision(override_module_mixed_precision(root, no_mp_classes))
        return {
            module: {**root_kwargs, **kwargs}
            for module, kwargs in chosen.items()
            if module is not root and module not in ignored_modules and can_be_unit(module)
        }
    if no_mp_classes:
        policy = functools.partial(
            or_policy,
            policies=[
                policy,
                functools.partial(wrap_module_cls_individually, module_classes=no_mp_classes),
            ],
        )
        warn_on_overridden_mixed_precision(override_module_mixed_precision(root, no_mp_classes))
    chosen_modules: list[nn.Module] = []
    _select_recursively(root, policy, ignored_modules, ignored_params, chosen_modules, is_root=True)
    return {
        module: {
            **root_kwargs,
            **({"mixed_precision": None} if isinstance(module, no_mp_classes) else {}),
        }
        for module in chosen_modules
        if can_be_unit(module)
    }


def check_not_wrapped(root: nn.Module) -> None:
    """``ValueError`` (FSDP1's words) if ``root`` or a module in it already is an FSDP unit
    or a ``fully_shard`` module: an auto-wrap policy would choose units across them."""
    for name, module in root.named_modules():
        if is_unit(module) or isinstance(module, FSDPModule):
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but "
                f"found {name} in\n{root}"
            )


def _select_recursively(
    module: nn.Module,
    policy: Callable[..., bool],
    ignored_modules: frozenset[nn.Module],
    excluded_params: frozenset[nn.Parameter] | set[nn.Parameter],
    chosen: list[nn.Module],
    is_root: bool = False,
) -> int:
    """FSDP1's recursive-wrap decision procedure, recording choices instead of wrapping.

    Returns the number of parameters that ended up in units chosen at or below ``module``.
    """
    nonwrapped_numel = sum(p.numel() for p in module.parameters() if p not in excluded_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return 0
    wrapped_numel = 0
    for child in module.children():
        if child in ignored_modules:
            continue
        wrapped_numel += _select_recursively(
            child, policy, ignored_modules, excluded_params, chosen
        )
    remainder = nonwrapped_numel - wrapped_numel
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        chosen.append(module)
        return nonwrapped_numel
    return wrapped_numel


def wrap_bottom_up(
    root: nn.Module,
    targets: dict[nn.Module, dict[str, Any]],
    wrap_fn: WrapFn,
) -> None:
    """Replace every target below ``root`` by ``wrap_fn(target, kwargs)``, children first.

    Replacements happen in place; a caller that must undo a failure part-way snapshots the
    tree first (:class:`._rollback.TreeSnapshot`).
    """
    done: set[nn.Module] = set()

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            if child in done:
                continue
            done.add(child)
            visit(child, f"{prefix}{name}.")
            if child in targets:
                logger.debug("auto-wrap: %r (%s) is a unit", prefix + name, type(child).__name__)
                submodule_slots(module)[name] = wrap_fn(child, targets[child])

    visit(root, "")
