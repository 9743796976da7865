"""Where a unit computes, and whether its offloaded shards are pinned, on gloo ranks.

NCCL is simulated where the decision needs it: torch's answer for the group's device type
(``collective_device_type``) says ``"cuda"`` and the current CUDA device is mocked. The
rule (FSDP1's, ``torch/distributed/fsdp/_init_utils.py``): a CPU or meta module without
``device_id`` computes on the current CUDA device over NCCL; over gloo it stays a CPU rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp import _common as C


@contextlib.contextmanager
def nccl_groups(except_for: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Every process group but ``except_for`` reports NCCL's device type; CUDA device 1 is
    current."""
    from fsdp_interactive.fsdp import _comm_device

    real = _comm_device.collective_device_type

    def collective_device_type(group=None):
        return real(group) if group is except_for and group is not None else "cuda"

    with (
        mock.patch.object(_comm_device, "collective_device_type", collective_device_type),
        mock.patch.object(torch.cuda, "current_device", lambda: 1),
    ):
        yield


def compute_devices() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_interactive.fsdp._init import resolve_device

    cpu_module = nn.Linear(2, 2)
    meta_module = nn.Linear(2, 2, device="meta")
    gloo = dist.new_group(backend="gloo")
    cpu_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    none = frozenset()
    out = {
        "gloo, CPU module": resolve_device(None, cpu_module, none),
        "gloo, meta module": resolve_device(None, meta_module, none),
    }
    with nccl_groups(except_for=gloo):
        out["nccl, CPU module"] = resolve_device(None, cpu_module, none)
        out["nccl, meta module"] = resolve_device(None, meta_module, none)
        out["nccl, hybrid groups"] = resolve_device(
            None, cpu_module, none, process_group=(dist.group.WORLD, gloo)
        )
        out["nccl, gloo process_group"] = resolve_device(None, cpu_module, none, process_group=gloo)
        out["nccl, cpu device_mesh"] = resolve_device(None, meta_module, none, device_mesh=cpu_mesh)
        out["nccl, device_id=cpu"] = resolve_device(torch.device("cpu"), meta_module, none)
    return {k: str(v) for k, v in out.items()}


def test_cpu_and_meta_modules_compute_where_their_group_communicates(ranks2):
    for result in ranks2.run(compute_devices):
        assert result == {
            "gloo, CPU module": "cpu",
            "gloo, meta module": "cpu",
            "nccl, CPU module": "cuda:1",
            "nccl, meta module": "cuda:1",
            "nccl, hybrid groups": "cuda:1",  # the shard (intra-node) group decides
            "nccl, gloo process_group": "cpu",
            "nccl, cpu device_mesh": "cpu",
            "nccl, device_id=cpu": "cpu",
        }


def meta_module_materialized_by_the_constructor() -> dict:
    """The computed device reaches materialization (here: gloo, the CPU) and the mesh."""
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    with torch.device("meta"):
        model = C.make_model(0)
    wrapped = FSDP(model, use_orig_params=True)
    local = wrapped.embed.weight.to_local()
    return {
        "compute_device": str(wrapped.compute_device),
        "mesh": wrapped.device_mesh.device_type,
        "shard": str(local.device),
        "finite": bool(torch.isfinite(local).all()),
    }


def test_a_meta_module_without_device_id_is_materialized_on_the_compute_device(ranks2):
    for result in ranks2.run(meta_module_materialized_by_the_constructor):
        assert result == {"compute_device": "cpu", "mesh": "cpu", "shard": "cpu", "finite": True}


@pytest.mark.parametrize(
    "device,pinned", [("cpu", False), ("meta", False), ("cuda:0", True), ("cuda", True)]
)
def test_offloaded_shards_are_pinned_only_for_an_accelerator_unit(device, pinned):
    from fsdp_interactive.fsdp import CPUOffload
    from fsdp_interactive.fsdp._config import offload_policy

    with mock.patch.object(torch.accelerator, "is_available", lambda: True):  # a GPU host
        policy = offload_policy(CPUOffload(offload_params=True), torch.device(device))
    assert policy.pin_memory is pinned


def offloaded_cpu_rank_on_a_gpu_host() -> dict:
    from fsdp_interactive.fsdp import CPUOffload
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp._unit_state import unit_state

    # The host has an accelerator, this rank computes on the CPU (gloo). Pinning would
    # allocate through the accelerator (on this CPU-only torch build: fail outright).
    with mock.patch.object(torch.accelerator, "is_available", lambda: True):
        model = FSDP(
            C.make_model(0), cpu_offload=CPUOffload(offload_params=True), use_orig_params=True
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    C.lm_loss(model, C.local_part(C.batches(0, world), rank, world)).backward()
    return {
        "pin_memory": unit_state(model).config.offload_policy.pin_memory,
        "shard": str(model.embed.weight.to_local().device),
        "trained": model.embed.weight.grad is not None,
    }


def test_a_cpu_rank_on_a_gpu_host_does_not_pin_its_offloaded_shards(ranks2):
    for result in ranks2.run(offloaded_cpu_rank_on_a_gpu_host):
        assert result == {"pin_memory": False, "shard": "cpu", "trained": True}
