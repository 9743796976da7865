"""``summon_stats`` and ``edit_param``: look at and edit full parameters (rank side).

Both are collectives: every rank of the parameters' mesh must call them with the same
arguments.  ``summon_stats`` gathers no parameter: each rank summarizes its own shard and
the summaries are combined.  ``edit_param`` needs the full tensor, since it writes back:
it is gathered with ``FullyShardedDataParallel.summon_full_params`` when the model is
wrapped by :mod:`fsdp_interactive.fsdp`, else with ``DTensor.full_tensor()``; plain tensors
are read directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import parameter_slots
from fsdp_interactive.fsdp._comm_device import gather_full
from fsdp_interactive.fsdp._summon import local_slice, summon_full_params
from fsdp_interactive.fsdp._traversal import owned_modules, units
from fsdp_interactive.fsdp._unit_state import is_unit, unit_state
from fsdp_interactive.inspect._dtensor import local_tensor, named_parameters
from fsdp_interactive.inspect._records import TensorStats
from fsdp_interactive.inspect._shard_stats import tensor_stats


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
def _editable_full_params(
    model: nn.Module, chosen: list[tuple[str, nn.Parameter]]
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield name -> full tensor; in-place edits of those tensors are written back to each
    rank's shard when the block ends (collective)."""
    if any(is_unit(m) for m in model.modules()):
        with contextlib.ExitStack() as stack:
            # Only the units that own the chosen parameters: an edit of one parameter costs
            # one unit's all-gather, whatever the size of the model.
            for unit in _owning_units(model, chosen):
                stack.enter_context(summon_full_params(unit, recurse=False, writeback=True))
            full = dict(named_parameters(model))
            missing = [name for name, _ in chosen if name not in full]
            if missing:
                raise KeyError(f"parameters {missing} are not visible under summon_full_params")
            yield {name: full[name].data for name, _ in chosen}
        return
    edited = {name: _gathered(p) for name, p in chosen}
    yield edited
    with torch.no_grad():
        for name, param in chosen:
            _write_full_into(param, edited[name])


def _gathered(param: nn.Parameter) -> torch.Tensor:
    """A full copy of ``param`` on the device its data is kept on (a collective for a
    DTensor, gathered on its mesh's communication device: an offloaded shard of a CUDA
    mesh goes through the GPU, as NCCL gathers CUDA tensors only)."""
    if not isinstance(param, DTensor):
        return param.data.detach().clone()
    home = local_tensor(param).device
    return gather_full(param, to_cpu=home.type == "cpu").to(home)


def _write_full_into(param: nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's piece of ``full`` into ``param`` in place (keeps its identity)."""
    if not isinstance(param, DTensor):
        param.data.copy_(full)
        return
    param.to_local().copy_(local_slice(full, param))


def summon_stats(model: nn.Module, fqn: str, bins: int = 40) -> TensorStats:
    """Statistics of the full parameter ``fqn`` (or all parameters of module ``fqn``).

    A collective over the parameters' mesh; the result is the same on every rank.  Stats
    (mean/std/min/max/norm and the histogram) are over finite values in float64; NaN and
    Inf are counted.  Each rank summarizes the shard it holds and only those few numbers
    are gathered (see :mod:`fsdp_interactive.inspect._shard_stats`): no full parameter is
    gathered or allocated, so the cost follows the shard's size.  Nothing is modified.
    """
    chosen = select_params(model, fqn)
    return tensor_stats(fqn, [n for n, _ in chosen], [p for _, p in chosen], bins)


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
    with torch.no_grad(), _editable_full_params(model, chosen) as full:
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
