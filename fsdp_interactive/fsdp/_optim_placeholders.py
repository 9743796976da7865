"""Optimizer state for an optimizer that has none yet: allocated placeholders a load can fill.

torch's documented DCP recipe loads a checkpoint *into* the state dict it is given::

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, storage_reader=reader)
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))

An optimizer creates its state at its first ``step()``, so right after construction its
state dict has no tensors for ``dcp.load`` to fill, and (in torch FSDP1) the optimizer
silently stays fresh. Here :func:`allocate` gives such an optimizer the tensors its first
step would create, as placeholders, without changing the optimizer:

* the structure (keys, shapes, dtypes, sharding) comes from running ``optim.step()`` once
  with zero gradients and a learning rate of 0, as torch's ``get_optimizer_state_dict``
  does, but each state value is captured as the optimizer *creates* it, before the step
  updates it (Adam's ``step`` is 0, its moments are zeros); afterwards the optimizer's
  state, gradients and learning rates are exactly as they were (empty state, same grads);
* :func:`is_untouched` tells a placeholder that nothing has written into since (its
  storage's version counter is unchanged) from one a load filled.

So ``optim_state_dict_to_load`` applies what ``dcp.load`` wrote and drops the entries no
one wrote: loading an unfilled placeholder state leaves the optimizer fresh, as loading
FSDP1's empty state does.

Saving a never-stepped optimizer writes the placeholder values. For Adam, AdamW, Adamax,
NAdam, RAdam, RMSprop, Adagrad (with its default ``initial_accumulator_value``) they are the
values the optimizer starts from, so resuming from such a checkpoint equals starting fresh.
Not so for: SGD with ``dampening != 0`` (its first momentum buffer is the gradient itself,
a zero placeholder is not), and Rprop's ``step_size`` / ASGD's ``eta``, which start from
the learning rate (0 while capturing).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from itertools import chain
from typing import Any

import torch

from fsdp_interactive._torch_compat import version_counter

# id(tensor) -> (weak reference to it, version counter when it was handed out).
_PLACEHOLDERS: dict[int, tuple[weakref.ref, int]] = {}


class _FirstValues(dict):
    """A state entry that also keeps a copy of the first value set under each key."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.first:
            self.first[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)


def has_state(optim: torch.optim.Optimizer) -> bool:
    """Whether any parameter of ``optim`` has optimizer state."""
    return any(bool(s) for s in optim.state.values())


@torch.no_grad()
def initial_state(optim: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """The state ``optim``'s first step creates, per parameter, before the step updates it.

    ``optim`` is left as it was (its ``state``, the parameters' ``grad`` and each group's
    ``lr``); its parameters are not changed (learning rate 0, zero gradients).
    """
    params = list(chain.from_iterable(g["params"] for g in optim.param_groups))
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optim.param_groups]
    live_state = optim.state
    recorder: defaultdict[torch.Tensor, _FirstValues] = defaultdict(_FirstValues)
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        for group in optim.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        optim.state = recorder
        optim.step()
    finally:
        optim.state = live_state
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for group, lr in zip(optim.param_groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
    return {p: dict(entry.first) for p, entry in recorder.items() if entry.first}


def allocate(optim: torch.optim.Optimizer) -> None:
    """Put placeholder state (:func:`initial_state`) into the fresh ``optim``.

    The caller reads the state dict, passes it to :func:`remember` and calls :func:`clear`
    to make ``optim`` fresh again.
    """
    for param, entry in initial_state(optim).items():
        optim.state[param] = entry


def clear(optim: torch.optim.Optimizer) -> None:
    """Make ``optim`` fresh again after :func:`allocate` (no state for any parameter)."""
    optim.state.clear()


def remember(state: dict[Any, dict[str, Any]]) -> None:
    """Mark every tensor of ``state`` (``{param key: {name: value}}``) as a placeholder."""
    for entry in state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                _remember(value)


def _remember(tensor: torch.Tensor) -> None:
    key = id(tensor)
    ref = weakref.ref(tensor, lambda _ref, key=key: _PLACEHOLDERS.pop(key, None))
    _PLACEHOLDERS[key] = (ref, version_counter(tensor))


def is_untouched(value: Any) -> bool:
    """Whether ``value`` is a placeholder from :func:`allocate` that nothing wrote into."""
    if not isinstance(value, torch.Tensor):
        return False
    known = _PLACEHOLDERS.get(id(value))
    if known is None or known[0]() is not value:
        return False
    return version_counter(value) == known[1]


def unfilled(entry: dict[str, Any]) -> bool:
    """Whether a parameter's state entry holds placeholders only, none of them written."""
    tensors = [v for v in entry.values() if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(is_untouched(v) for v in tensors)
