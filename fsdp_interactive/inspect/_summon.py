"""``summon_stats`` and ``edit_param``: look at and edit full parameters (rank side).

Both are collectives: every rank of the parameters' mesh must call them with the same
arguments.  Full tensors are gathered with ``FullyShardedDataParallel.summon_full_params``
when the model is wrapped by :mod:`fsdp_interactive.fsdp`, else with
``DTensor.full_tensor()``; plain tensors are read directly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import parameter_slots
from fsdp_interactive.fsdp._summon import local_slice, summon_full_params
from fsdp_interactive.fsdp._traversal import owned_modules, units
from fsdp_interactive.fsdp._unit_state import is_unit, unit_state
from fsdp_interactive.inspect._dtensor import named_parameters
from fsdp_interactive.inspect._records import TensorStats


def select_params(model: nn.Module, fqn: str) -> list[tuple[str, nn.Parameter]]:
    """The parameter named ``fqn``, or every parameter of the module named ``fqn``."""
    params = dict(named_parameters(model))
    if fqn in params:
        return [(fqn, params[fqn])]
    prefix = f"{fqn}." if fqn else ""
    chosen = [(name, p) for name, p in params.items() if name.startswith(prefix)]
    if not chosen:
        sample = ", ".join(list(params)[:6])
        raise KeyError(
            f"no parameter or module named {fqn!r} in the model; parameter names look like: "
            f"{sample}"
        )
    return chosen


def _owning_units(model: nn.Module, chosen: list[tuple[str, nn.Parameter]]) -> list[nn.Module]:
    """The units of ``model`` whose own parameters include one of ``chosen``, in order."""
    wanted = {id(param) for _, param in chosen}
    owners = []
    for unit in units(model):
        state = unit_state(unit)
        assert state is not None
        modules = owned_modules(state.sharded_module, state.ignored.modules)
        if any(id(p) in wanted for m in modules for p in parameter_slots(m).values()):
            owners.append(unit)
    return owners


@contextlib.contextmanager
def _full_params(
    model: nn.Module, chosen: list[tuple[str, nn.Parameter]], writeback: bool = False
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield name -> full tensor; with ``writeback`` edits of those tensors are kept."""
    if any(is_unit(m) for m in model.modules()):
        with contextlib.ExitStack() as stack:
            # Only the units that own the chosen parameters: a probe of one parameter costs
            # one unit's all-gather, whatever the size of the model.
            for unit in _owning_units(model, chosen):
                stack.enter_context(summon_full_params(unit, recurse=False, writeback=writeback))
            full = dict(named_parameters(model))
            missing = [name for name, _ in chosen if name not in full]
            if missing:
                raise KeyError(f"parameters {missing} are not visible under summon_full_params")
            yield {name: full[name].data for name, _ in chosen}
        return
    full = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p.data).detach() for name, p in chosen
    }
    if not writeback:
        yield full
        return
    edited = {name: t.clone() for name, t in full.items()}
    yield edited
    with torch.no_grad():
        for name, param in chosen:
            _write_full_into(param, edited[name])


def _write_full_into(param: nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's piece of ``full`` into ``param`` in place (keeps its identity)."""
    if not isinstance(param, DTensor):
        param.data.copy_(full)
        return
    param.to_local().copy_(local_slice(full, param))


def tensor_stats(fqn: str, names: list[str], tensors: list[torch.Tensor], bins: int) -> TensorStats:
    """Stats of ``tensors`` taken together (a single tensor keeps its shape)."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    shape = tuple(tensors[0].shape) if len(tensors) == 1 else (sum(t.numel() for t in tensors),)
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    finite = flat[torch.isfinite(flat)]
    nan_count = int(flat.isnan().sum())
    inf_count = int(flat.isinf().sum())
    if finite.numel():
        lo, hi = float(finite.min()), float(finite.max())
        counts = torch.histc(finite, bins=bins, min=lo, max=hi if hi > lo else lo + 1.0)
        edges = torch.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
        mean = float(finite.mean())
        std = float(finite.std()) if finite.numel() > 1 else 0.0
        norm = float(torch.linalg.vector_norm(finite))
    else:
        lo = hi = mean = std = norm = math.nan
        counts, edges = torch.zeros(bins), torch.zeros(bins + 1)
    return TensorStats(
        fqn=fqn,
        names=tuple(names),
        shape=tuple(int(s) for s in shape),
        dtype=dtype,
        numel=int(flat.numel()),
        mean=mean,
        std=std,
        min=lo,
        max=hi,
        norm=norm,
        nan_count=nan_count,
        inf_count=inf_count,
        hist_counts=tuple(int(c) for c in counts.tolist()),
        hist_edges=tuple(float(e) for e in edges.tolist()),
    )


def summon_stats(model: nn.Module, fqn: str, bins: int = 40) -> TensorStats:
    """Statistics of the full parameter ``fqn`` (or all parameters of module ``fqn``).

    A collective over the parameters' mesh; the result is the same on every rank.  Stats
    (mean/std/min/max/norm and the histogram) are over finite values in float64; NaN and
    Inf are counted.  Nothing is modified.
    """
    chosen = select_params(model, fqn)
    with _full_params(model, chosen, writeback=False) as full:
        return tensor_stats(fqn, [n for n, _ in chosen], [full[n] for n, _ in chosen], bins)


def edit_param(model: nn.Module, fqn: str, expression: str, bins: int = 40) -> TensorStats:
    """Apply ``expression`` to the full parameter ``fqn`` and write it back; return new stats.

    ``expression`` sees ``x`` (the full parameter, editable in place) and ``torch``.  Either
    it is an expression whose value becomes the new parameter (``x * 0.5``; same shape
    required) or statements that change ``x`` in place (``x[0] = 0``).  Every rank evaluates
    it on the same full tensor and writes its own piece back (the equivalent of
    ``summon_full_params(writeback=True)``); the parameter objects, and so the optimizer's
    references to them, stay the same.  Only parameters, not modules, can be edited.  A
    failing expression leaves the parameter unchanged.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string such as 'x[0] = 0' or 'x * 0.5'")
    chosen = select_params(model, fqn)
    if len(chosen) != 1 or chosen[0][0] != fqn:
        raise ValueError(f"edit_param edits one parameter; {fqn!r} is a module, name a parameter")
    with torch.no_grad(), _full_params(model, chosen, writeback=True) as full:
        target = full[fqn]
        candidate = target.clone()
        namespace = {"x": candidate, "torch": torch}
        try:
            code = compile(expression, "<edit>", "eval")
        except SyntaxError:
            exec(compile(expression, "<edit>", "exec"), namespace)
            result = namespace["x"]
        else:
            result = eval(code, namespace)
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(target.shape):
            raise ValueError(
                f"expression must give a tensor of shape {tuple(target.shape)}, got "
                f"{type(result).__name__}"
                + (f" of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else "")
            )
        target.copy_(result)
    return summon_stats(model, fqn, bins=bins)
