"""Per-unit initialization before sharding: device, meta materialization, rank-0 sync.

Each FSDP unit runs, on the modules it owns (``_traversal.owned_modules``), in order, just
before ``fully_shard`` shards it:

1. :func:`materialize` - if any owned parameter or buffer is on the meta device:
   ``param_init_fn(m)`` for every owned module ``m`` when given (FSDP1's contract), else
   ``m.to_empty(device, recurse=False)`` + ``m.reset_parameters()`` for every owned module
   that directly holds states. Because units are built bottom-up and sharded right after this
   step, a meta-device model is never whole on one rank: the peak is the sharded rest plus
   one unit's full parameters. Once the unit is sharded, :func:`release_freed_memory`
   hands the freed full tensors' pages back to the OS (glibc keeps freed heap memory
   otherwise, so each unit's full copy would add to the process's resident size).
   A parameter shared by several owned modules (tied embeddings) stays shared: a per-module
   ``to_empty`` gives each module its own new tensor, so afterwards every module that shared
   it gets the one its first holder (in ``modules`` order) ended up with.
2. :func:`broadcast_from_rank0` - with ``sync_module_states``, the owned parameters and
   buffers are broadcast from the mesh's first rank (coalesced per dtype, sent on the mesh's
   device, so CPU-resident modules work with NCCL too).

Not done here: moving states to the compute device (``fully_shard`` moves the parameters and
buffers it manages; ignored modules are moved by the constructor when ``device_id`` is given).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import sys
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_interactive._torch_compat import (
    flatten_dense_tensors,
    parameter_slots,
    unflatten_dense_tensors,
)
from fsdp_interactive.fsdp._comm_device import comm_device

logger = logging.getLogger(__name__)


def resolve_device(
    device_id: int | torch.device | None,
    module: nn.Module,
    ignored_params: frozenset[nn.Parameter],
    *,
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
    device_mesh: DeviceMesh | None = None,
) -> torch.device:
    """The compute device: ``device_id`` if given, else the accelerator device the module's
    states are on, else (a module on CPU or meta) the communication device of the group it
    is sharded over.

    An ``int`` names an index of the current accelerator type (FSDP1: a CUDA index); a
    ``torch.device`` without an index on an accelerator means the current index. For an
    accelerator device with another index than the current one, the current device is
    switched to it (``fully_shard`` computes on the current device of the mesh's type).

    A CPU or meta module without ``device_id`` computes where its group communicates
    (:func:`~._comm_device.comm_device` of ``device_mesh``, else of ``process_group``'s
    shard group, else of the default group): over an NCCL-only group that is the current
    CUDA device, where FSDP1 computes too (``torch/distributed/fsdp/_init_utils.py``,
    torch 2.13: ``_get_compute_device`` line 1100 takes ``device_handle.current_device()``
    for a module on CPU, ``_materialize_meta_module`` line 924 materializes meta modules
    there); ``fully_shard`` then moves the states there and meta modules are materialized
    there. Over gloo it is the CPU: CPU ranks, where FSDP1 would still pick the accelerator
    (line 388) and need ``device_id=torch.device("cpu")``.
    """
    device = _requested_device(device_id, module, ignored_params)
    if device is None:
        device = _group_device(process_group, device_mesh)  # the current device already
        logger.debug("module on CPU/meta without device_id: computing on %s", device)
        return device
    accelerator_index = device.index if device.type not in ("cpu", "meta") else None
    if (
        accelerator_index is not None
        and torch.accelerator.current_device_index() != accelerator_index
    ):
        torch.accelerator.set_device_index(accelerator_index)
    return device


def _group_device(
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    device_mesh: DeviceMesh | None,
) -> torch.device:
    if device_mesh is not None:
        return comm_device(device_mesh)
    if isinstance(process_group, tuple):
        return comm_device(process_group[0])  # (intra-node shard group, inter-node group)
    return comm_device(process_group)


def _requested_device(
    device_id: int | torch.device | None,
    module: nn.Module,
    ignored_params: frozenset[nn.Parameter],
) -> torch.device | None:
    """``device_id`` as a device, else the accelerator device of the module's states, else
    ``None`` (states on CPU or meta only)."""
    if isinstance(device_id, int):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise ValueError(
                f"device_id={device_id} names an accelerator device index, but no accelerator "
                "is available; pass device_id=torch.device('cpu') or None for CPU ranks"
            )
        return torch.device(accelerator.type, device_id)
    if isinstance(device_id, torch.device):
        if device_id.type not in ("cpu", "meta") and device_id.index is None:
            return torch.device(device_id.type, torch.accelerator.current_device_index())
        if device_id.type == "meta":
            raise ValueError("device_id cannot be the meta device")
        return device_id
    devices = {
        t.device
        for t in _states(module.modules(), ignored_params)
        if t.device.type not in ("cpu", "meta")
    }
    if len(devices) > 1:
        raise ValueError(
            f"module has parameters/buffers on several devices {sorted(map(str, devices))}; "
            "pass device_id to choose the compute device"
        )
    return devices.pop() if devices else None


def _states(
    modules: Iterable[nn.Module], ignored_params: frozenset[nn.Parameter]
) -> Iterable[torch.Tensor]:
    for module in modules:
        for param in module.parameters(recurse=False):
            if param not in ignored_params:
                yield param
        for buf in module.buffers(recurse=False):
            if buf is not None:
                yield buf


def has_meta_states(modules: list[nn.Module], ignored_params: frozenset[nn.Parameter]) -> bool:
    return any(t.is_meta for t in _states(modules, ignored_params))


def materialize(
    modules: list[nn.Module],
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
    ignored_params: frozenset[nn.Parameter],
) -> None:
    """Give the owned meta-device states real storage (see the module docstring)."""
    if logger.isEnabledFor(logging.DEBUG):
        kinds = collections.Counter(type(m).__name__ for m in modules)
        logger.debug(
            "materializing %d meta-device module(s) on %s with %s: %s",
            len(modules),
            device,
            "param_init_fn" if param_init_fn is not None else "reset_parameters()",
            ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()),
        )
    shared = _shared_parameter_slots(modules)
    if param_init_fn is not None:
        for module in modules:
            param_init_fn(module)
    else:
        with torch.no_grad():
            for module in modules:
                if not any(True for _ in _states([module], frozenset())):
                    continue
                module.to_empty(device=device, recurse=False)
                reset = getattr(module, "reset_parameters", None)
                if not callable(reset):
                    raise ValueError(
                        f"cannot materialize a meta-device {type(module).__name__}: it has no "
                        "reset_parameters(); pass param_init_fn to initialize it"
                    )
                reset()
    _retie(shared)
    still_meta = [type(m).__name__ for m in modules if has_meta_states([m], ignored_params)]
    if still_meta:
        raise ValueError(
            "param_init_fn left parameters or buffers on the meta device in "
            f"{sorted(set(still_meta))}; it must materialize the module it is given"
        )


def _shared_parameter_slots(modules: list[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """(module, name) slots of every parameter held by more than one of ``modules``."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in modules:
        for name, param in parameter_slots(module).items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, name))
    return [group for group in slots.values() if len(group) > 1]


def _retie(shared: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each group of slots hold one parameter again: its first slot's."""
    for (first_module, first_name), *others in shared:
        param = parameter_slots(first_module)[first_name]
        for module, name in others:
            if parameter_slots(module)[name] is not param:
                logger.debug("re-tying %s.%s to its shared parameter", type(module).__name__, name)
                parameter_slots(module)[name] = param


def release_freed_memory() -> bool:
    """Return freed heap pages to the OS (glibc's ``malloc_trim(0)``); whether it ran.

    A no-op (``False``) where the C library has no ``malloc_trim`` (not glibc).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


@torch.no_grad()
def broadcast_from_rank0(
    modules: list[nn.Module], ignored_params: frozenset[nn.Parameter], mesh: DeviceMesh
) -> None:
    """Overwrite the owned parameters and buffers with the mesh's first rank's values."""
    tensors = [t for t in _states(modules, ignored_params) if t.numel() > 0]
    if not tensors:
        return
    source = int(mesh.mesh.flatten()[0])
    group = _mesh_group(mesh)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    device = comm_device(mesh)
    for bucket in by_dtype.values():
        # Communicate on the mesh's device (NCCL cannot send CPU tensors); copy back after.
        flat = flatten_dense_tensors([t.detach() for t in bucket]).to(device)
        dist.broadcast(flat, src=source, group=group)
        for t, synced in zip(bucket, unflatten_dense_tensors(flat, bucket), strict=True):
            t.copy_(synced)


def _mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """A group spanning every rank of ``mesh`` (the default group if the mesh covers it)."""
    if mesh.mesh.numel() == dist.get_world_size():
        return None
    if mesh.ndim == 1:
        return mesh.get_group(0)
    raise ValueError(
        "sync_module_states over a multi-dimensional mesh needs the mesh to span all ranks"
    )
