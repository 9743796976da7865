"""``summon_stats`` and ``edit_param``: look at and edit full parameters (rank side).

Both are collectives: every rank of the parameters' groups must call them with the same
arguments. Parameters are read through :func:`fsdp_interactive.wrapping.model_params`, so
any wrapping it understands works, and names may be clean or wrapped. ``summon_stats``
gathers no parameter: each rank summarizes its own piece and the summaries are combined.
``edit_param`` needs the full tensor, since it writes back: it is gathered by the
framework that shards it, with ``summon_full_params`` of the unit that owns the parameter
(this package's ``FullyShardedDataParallel``, torch's FSDP1), else with
``DTensor.full_tensor()``; tensors every rank holds whole are edited in place.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import parameter_slots
from fsdp_interactive.fsdp._summon_full_params import local_slice, summon_full_params
from fsdp_interactive.fsdp._traversal import owned_modules, units
from fsdp_interactive.fsdp._unit_state import is_unit, unit_state
from fsdp_interactive.inspect._inputs import ProbeInputError
from fsdp_interactive.inspect._records import TensorStats
from fsdp_interactive.inspect._shard_stats import tensor_stats
from fsdp_interactive.wrapping import OriginalParam, model_params
from fsdp_interactive.wrapping._param import FlatShardParam


def _owning_units(model: nn.Module, param: OriginalParam) -> list[nn.Module]:
    """The units of ``model`` (this package's wrapper) whose own parameters include ``param``."""
    owners = []
    for unit in units(model):
        state = unit_state(unit)
        assert state is not None
        modules = owned_modules(state.sharded_module, state.ignored.modules)
        if any(p is param.tensor for m in modules for p in parameter_slots(m).values()):
            owners.append(unit)
    return owners


def _attribute(model: nn.Module, dotted: str) -> torch.Tensor:
    """What ``model.<dotted>`` is now (inside ``summon_full_params``: the full tensor)."""
    return functools.reduce(getattr, dotted.split("."), model)


@contextlib.contextmanager
def _editable_full(model: nn.Module, param: OriginalParam) -> Iterator[torch.Tensor]:
    """Yield the full parameter; in-place edits of it are written back to every rank's
    piece when the block ends (a collective over the parameter's groups)."""
    if isinstance(param, FlatShardParam):
        # torch FSDP1's own gather and write-back, of the one unit that owns it.
        unit = param.shard.unit_module
        with TorchFSDP.summon_full_params(unit, recurse=False, writeback=True):
            yield _attribute(model, param.wrapped_name).data
        return
    if isinstance(param.tensor, DTensor) and any(is_unit(m) for m in model.modules()):
        with contextlib.ExitStack() as stack:
            # Only the units that own the parameter: an edit of one parameter costs one
            # unit's all-gather, whatever the size of the model.
            for unit in _owning_units(model, param):
                stack.enter_context(summon_full_params(unit, recurse=False, writeback=True))
            yield _attribute(model, param.wrapped_name).data
        return
    edited = param.full_tensor()
    yield edited
    tensor = param.tensor
    assert tensor is not None
    with torch.no_grad():
        # In place: the parameter object, and so the optimizer's reference, stays.
        if isinstance(tensor, DTensor):
            tensor.to_local().copy_(local_slice(edited, tensor))
        else:
            tensor.data.copy_(edited)


def summon_stats(model: nn.Module, fqn: str, bins: int = 40) -> TensorStats:
    """Statistics of the full parameter ``fqn`` (or all parameters of module ``fqn``),
    named clean or wrapped; the result names it by its clean FQN.

    A collective over the parameters' mesh; the result is the same on every rank.  Stats
    (mean/std/min/max/norm and the histogram) are over finite values in float64; NaN and
    Inf are counted.  Each rank summarizes the shard it holds and only those few numbers
    are gathered (see :mod:`fsdp_interactive.inspect._shard_stats`): no full parameter is
    gathered or allocated, so the cost follows the shard's size.  Nothing is modified.
    """
    params = model_params(model)
    return tensor_stats(params.clean_name(fqn), params.select(fqn), bins)


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
        raise ProbeInputError(
            "expression must be a non-empty string such as 'x[0] = 0' or 'x * 0.5'"
        )
    params = model_params(model)
    if not params.is_parameter(fqn):
        params.select(fqn)  # KeyError for a name that is neither
        raise ProbeInputError(
            f"edit_param edits one parameter; {fqn!r} is a module, name a parameter"
        )
    param = params[params.resolve(fqn)]
    with torch.no_grad(), _editable_full(model, param) as target:
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
            raise ProbeInputError(
                f"expression must give a tensor of shape {tuple(target.shape)}, got "
                f"{type(result).__name__}"
                + (f" of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else "")
            )
        target.copy_(result)
    return summon_stats(model, param.fqn, bins=bins)
