"""Where a collective's tensors must live, and DTensor gathers that put them there.

A process group talks on the devices its backends serve: gloo on the CPU, NCCL on CUDA
only. A tensor handed to a collective must be on such a device, whatever device it is
kept on: with ``CPUOffload(offload_params=True)`` the local shards are on the CPU while
the mesh is ``cuda``, and an NCCL-only group refuses CPU tensors ("No backend type
associated with device type cpu"). The rule for rank-side code (``fsdp/``, ``inspect/``,
``checkpoint/``): a collective on tensors takes its device from :func:`comm_device`, and
a DTensor is gathered with :func:`gather_full`, which moves the local shard first, as
torch's own state-dict gather does (torch 2.13, ``torch/distributed/_state_dict_utils.py``
lines 268-269, ``_gather_state_dict``'s ``dtensor_func``:
``value.to(value.device_mesh.device_type)`` before ``redistribute``).

Contract:

* :func:`comm_device` -- for a DeviceMesh (or a DTensor's mesh): the CPU for a ``cpu``
  mesh, else the *current* device of the mesh's type (``fully_shard`` computes there, and
  ``DTensor.to("cuda")`` goes there). For a process group (``None``: the default group):
  the CPU when the group can communicate CPU tensors (gloo, or a ``"cpu:gloo,cuda:nccl"``
  group), else the current device of its device type (NCCL: the current CUDA device);
  torch's rule for object collectives (``distributed_c10d._get_object_coll_device``). The
  CPU where ``torch.distributed`` is not initialized. Asks no collective.
* :func:`on_comm_device` -- the DTensor with its local shard copied to ``comm_device``
  (itself when it is there); for collectives other than a full gather (``redistribute``).
* :func:`gather_full` -- the whole tensor of a DTensor: a collective over its mesh (every
  rank of the mesh calls it, in the same order). Gathers on ``comm_device`` of the mesh;
  with ``to_cpu`` the result is moved to the CPU and the device copy released before
  returning, so a loop over many DTensors holds at most one full tensor on the device at
  a time. The result is detached and never shares storage with the local shard (on an
  unsharded mesh the gather would return the shard itself).

Not done: nothing here picks a device for object collectives (``all_gather_object`` and
``broadcast_object_list`` choose their own); nothing moves a DTensor's shard for good
(the shard stays where it is kept; only the copy handed to the collective moves).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import collective_device_type, local_tensor

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")


def comm_device(target: DTensor | DeviceMesh | dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors collectives over ``target`` take (see the module docstring).

    ``target``: a DTensor (its mesh), a DeviceMesh, a process group, or ``None`` for the
    default group.
    """
    if isinstance(target, DTensor):
        target = target.device_mesh
    if isinstance(target, DeviceMesh):
        return device_of_type(target.device_type)
    if not (dist.is_available() and dist.is_initialized()):
        return CPU
    return device_of_type(collective_device_type(target))


def device_of_type(device_type: str) -> torch.device:
    """The CPU for ``"cpu"``, else this process's current device of ``device_type``."""
    if device_type == "cpu":
        return CPU
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def on_comm_device(tensor: DTensor) -> DTensor:
    """``tensor`` with its local shard on ``comm_device(tensor)`` (``tensor`` itself when it
    is there already; otherwise a copy, detached). No communication."""
    device = comm_device(tensor)
    if local_tensor(tensor).device == device:
        return tensor
    with torch.no_grad():
        return tensor.detach().to(device)


def gather_full(tensor: DTensor, *, to_cpu: bool) -> torch.Tensor:
    """The whole of ``tensor`` as a plain tensor (see the module docstring): on the CPU with
    ``to_cpu``, else on ``comm_device(tensor)``. A collective over ``tensor``'s mesh."""
    local = local_tensor(tensor)
    with torch.no_grad():
        full = on_comm_device(tensor.detach()).full_tensor()
        if to_cpu and full.device != CPU:
            full = full.to(CPU)  # rebinding releases the device copy before the next gather
        if _shares_storage(full, local):
            full = full.clone()
    return full


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
