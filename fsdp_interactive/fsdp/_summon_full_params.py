"""``summon_full_params``: whole parameters registered on the modules for a while.

For each target unit, every parameter the unit shards (a DTensor) is all-gathered in its
*original* dtype (mixed precision does not apply) and registered on its module as a plain
``nn.Parameter`` with the same ``requires_grad``; on exit the sharded DTensor parameter is
registered again, so the optimizer's parameter objects never change.

* ``writeback=True``: on exit each rank copies its slice of the (possibly edited) full
  parameter into its local shard. Edits persist on every rank's shard, because every rank
  copies from its own full copy; for NO_SHARD the slice is the whole tensor.
* ``rank0_only=True``: only rank 0 registers full parameters; other ranks take part in the
  gathers and keep their sharded parameters registered.
* ``offload_to_cpu=True``: the full parameters are placed on CPU, each moved there right
  after its gather (one full parameter on the device at a time); without ``rank0_only`` it
  warns, as FSDP1 does, that every rank's full copy in host memory risks running out of
  it. Without ``offload_to_cpu`` they are on the mesh's communication device, also for
  ``CPUOffload(offload_params=True)`` shards.
* ``with_grads=True``: each full parameter also gets the full gradient (all-gathered from the
  sharded gradient; zeros on ranks that hold none while others do). Gradient edits are not
  written back.

Every gather runs on the mesh's communication device (:mod:`._comm_device`): shards kept
on the CPU are copied there first, as an NCCL group takes no CPU tensor.

Ignored parameters and parameters outside any unit are left as they are. Buffers are not
touched. The units are first resharded (a no-op unless a forward without backward left a
unit's parameters unsharded), so the registered parameters are the sharded ones on entry.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import local_shape_and_offset, local_tensor, parameter_slots
from fsdp_interactive.fsdp import _comm_device
from fsdp_interactive.fsdp._traversal import busy_state, owned_modules, units
from fsdp_interactive.fsdp._unit_state import is_unit, unit_state


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Expose whole parameters (original dtype) on the units of ``module``.

    ``FullyShardedDataParallel.summon_full_params``. ``recurse=False`` only gathers
    ``module``'s own unit. See the module docstring for what each flag does. Raises
    ``NotImplementedError`` (a ``RuntimeError``) for ``rank0_only=True`` with
    ``writeback=True`` and for ``with_grads=True`` with ``offload_to_cpu=True``,
    ``AssertionError`` when called during forward, backward or another
    ``summon_full_params`` of the same units (FSDP1's types and words).
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
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "offload_to_cpu=True and rank0_only=False may result in the unsharded "
            "parameters being redundantly copied to CPU memory for GPUs sharing the same "
            "CPU memory, which risks CPU OOM. We recommend using offload_to_cpu=True with "
            "rank0_only=True.",
            stacklevel=3,
        )
    own_unit = [module] if is_unit(module) else []
    targets = units(module) if recurse else own_unit
    for unit in targets:
        _check_unsharded_manually_allowed(unit)
    states = [state for unit in targets if (state := unit_state(unit)) is not None]
    for state in states:
        state.sharded_module.reshard()
    plan = [
        (
            owned_modules(state.sharded_module, state.ignored.modules),
            state.config.layout.shard_group,
        )
        for state in states
    ]
    for state in states:
        state.summoning = True
    try:
        with summon_units(
            plan,
            writeback=writeback,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
        ):
            yield
    finally:
        for state in states:
            state.summoning = False


def _check_unsharded_manually_allowed(unit: nn.Module) -> None:
    """``AssertionError`` with FSDP1's words (its tests match them) when ``unit`` is in a
    forward, a backward or another ``summon_full_params``."""
    busy = busy_state(unit)
    if busy == "FORWARD_BACKWARD":
        raise AssertionError("Cannot manually unshard parameters during forward/backward")
    if busy == "SUMMON_FULL_PARAMS":
        raise AssertionError(
            "Cannot manually unshard parameters when already unsharding parameters "
            "(summon_full_params() inside summon_full_params() of the same units)"
        )


@dataclass
class _Swap:
    """One registration slot: ``module._parameters[name]`` held ``sharded`` before entry."""

    module: nn.Module
    name: str
    sharded: nn.Parameter
    full: nn.Parameter | None = None


@dataclass
class _UnitSwaps:
    swaps: list[_Swap] = field(default_factory=list)


def sharded_slots(modules: Sequence[nn.Module]) -> list[_Swap]:
    """Every (module, name) slot in ``modules`` that holds a DTensor parameter."""
    slots = []
    for module in modules:
        for name, param in parameter_slots(module).items():
            if isinstance(param, DTensor):
                slots.append(_Swap(module, name, param))
    return slots


def local_slice(full: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """The part (a view) of ``full`` that this rank's local shard of ``sharded`` holds."""
    shape, offset = local_shape_and_offset(sharded.shape, sharded.device_mesh, sharded.placements)
    view = full
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        view = view.narrow(dim, start, size)
    return view


@torch.no_grad()
def _gather_grads(slots: list[_Swap], group: dist.ProcessGroup) -> None:
    """Give each full parameter the full gradient of its sharded parameter.

    The flags saying which gradients exist are all-reduced on ``group``'s communication
    device (an NCCL-only group takes no CPU tensor).
    """
    flags = torch.tensor(
        [s.sharded.grad is not None for s in slots],
        dtype=torch.int32,
        device=_comm_device.comm_device(group),
    )
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    for slot, flag in zip(slots, flags.tolist(), strict=True):
        if not flag:
            continue
        grad = slot.sharded.grad
        if grad is None:
            shape, _ = local_shape_and_offset(
                slot.sharded.shape, slot.sharded.device_mesh, slot.sharded.placements
            )
            local = torch.zeros(
                shape, dtype=slot.sharded.dtype, device=local_tensor(slot.sharded).device
            )
            grad = DTensor.from_local(
                local, slot.sharded.device_mesh, slot.sharded.placements, run_check=False
            )
        full_grad = _comm_device.gather_full(grad, to_cpu=False)
        if slot.full is not None:
            slot.full.grad = full_grad.to(slot.full.device)


@contextlib.contextmanager
def summon_units(
    units: Sequence[tuple[Sequence[nn.Module], dist.ProcessGroup]],
    *,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    """Register full parameters on every owned module of ``units`` (see module docstring).

    ``units`` lists, per unit, its owned modules and its shard group (used to agree on which
    gradients exist).
    """
    keep_full = not rank0_only or dist.get_rank() == 0
    done: list[_UnitSwaps] = []
    full_of: dict[int, nn.Parameter] = {}
    gathered: set[int] = set()
    try:
        with torch.no_grad():
            for modules, group in units:
                record = _UnitSwaps(sharded_slots(modules))
                done.append(record)
                for slot in record.swaps:
                    key = id(slot.sharded)
                    if key not in gathered:
                        gathered.add(key)
                        # collective: every rank gathers, on the mesh's device
                        full = _comm_device.gather_full(
                            slot.sharded, to_cpu=offload_to_cpu and keep_full
                        )
                        if keep_full:
                            full_of[key] = nn.Parameter(
                                full, requires_grad=slot.sharded.requires_grad
                            )
                        del full
                    slot.full = full_of.get(key)
                if with_grads and record.swaps:
                    _gather_grads(record.swaps, group)
                if keep_full:
                    for slot in record.swaps:
                        parameter_slots(slot.module)[slot.name] = slot.full
        yield
    finally:
        with torch.no_grad():
            written: set[int] = set()
            for record in reversed(done):
                for slot in record.swaps:
                    current = parameter_slots(slot.module).get(slot.name)
                    if (
                        writeback
                        and keep_full
                        and current is not None
                        and id(slot.sharded) not in written
                    ):
                        if current.shape != slot.sharded.shape:
                            raise RuntimeError(
                                f"summon_full_params: parameter {slot.name!r} of "
                                f"{type(slot.module).__name__} changed shape from "
                                f"{tuple(slot.sharded.shape)} to {tuple(current.shape)}; "
                                "only values can be written back"
                            )
                        local = local_tensor(slot.sharded)
                        local.copy_(local_slice(current.detach(), slot.sharded).to(local.device))
                        written.add(id(slot.sharded))
                    parameter_slots(slot.module)[slot.name] = slot.sharded
