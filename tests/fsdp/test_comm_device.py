"""Every collective on tensors runs on its group's communication device, on gloo ranks.

With ``CPUOffload(offload_params=True)`` over NCCL the shards are on the CPU while the
group talks CUDA only. Here the shards are on the CPU too, and every communication device
the package asks for answers ``meta`` (``tests.device_standins``): each test checks that
the first collective of an operation is handed a tensor on that device (the shard moved
there first), not the CPU shard; and that the groups asked about are the right ones. The
operations then run for real on gloo with the right values (``tests/fsdp/test_summon.py``,
the state-dict and checkpoint tests).
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from tests.device_standins import first_collective
from tests.fsdp import _common as C
from tests.models import Block


def _offloaded():
    from fsdp_interactive.fsdp import CPUOffload
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        C.make_model(0),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        cpu_offload=CPUOffload(offload_params=True),
        use_orig_params=True,
    )
    optim = C.make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    C.lm_loss(model, C.local_part(C.batches(0, world), rank, world)).backward()
    optim.step()
    return model, optim


def first_collective_of_each_gather() -> dict[str, tuple[str, list[str]]]:
    from fsdp_interactive import inspect
    from fsdp_interactive.fsdp import FullStateDictConfig, StateDictType, _fqn_state
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model, optim = _offloaded()
    assert model.embed.weight.to_local().device.type == "cpu"

    def summon(**kwargs):
        with FSDP.summon_full_params(model, writeback=False, **kwargs):
            pass

    def full_state_dict():
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            model.state_dict()

    def full_optim_state_dict():
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            FSDP.optim_state_dict(model, optim)

    runs = {
        "summon_full_params": summon,
        "summon_full_params(offload_to_cpu)": lambda: summon(offload_to_cpu=True),
        "state_dict (FULL)": full_state_dict,
        "model_state(full)": lambda: _fqn_state.model_state(model, full=True, cpu_offload=True),
        "optim_state_dict (FULL)": full_optim_state_dict,
        "plain_copy": lambda: inspect.plain_copy(model.embed.weight),
        "clip_grad_norm_": lambda: model.clip_grad_norm_(1.0),
    }
    out = {}
    for name, run in runs.items():
        reached = first_collective(run)
        out[name] = (reached.name, reached.devices)
    return out


def test_gathers_of_cpu_offloaded_shards_run_on_the_communication_device(ranks2):
    for result in ranks2.run(first_collective_of_each_gather):
        for name, (collective, devices) in result.items():
            assert devices and set(devices) == {"meta"}, (name, collective, devices)
        gathers = {n for n, (collective, _) in result.items() if collective == "full_tensor"}
        assert gathers == set(result) - {"clip_grad_norm_"}, result
        assert result["clip_grad_norm_"][0] == "all_reduce"


def gradient_flags_collective() -> dict:
    from fsdp_interactive.fsdp import _summon_full_params
    from fsdp_interactive.fsdp._traversal import owned_modules
    from fsdp_interactive.fsdp._unit_state import unit_state

    model, _ = _offloaded()
    state = unit_state(model.blocks[0])
    group = state.config.layout.shard_group
    slots = _summon_full_params.sharded_slots(
        owned_modules(state.sharded_module, state.ignored.modules)
    )
    asked: list = []
    reached = first_collective(lambda: _summon_full_params._gather_grads(slots, group), asked)
    return {
        "collective": reached.name,
        "devices": reached.devices,
        "asked_the_shard_group": bool(asked) and all(g is group for g in asked),
    }


def test_summon_with_grads_reduces_its_flags_on_the_shard_groups_device(ranks2):
    for result in ranks2.run(gradient_flags_collective):
        assert result == {
            "collective": "all_reduce",
            "devices": ["meta"],
            "asked_the_shard_group": True,
        }


def sharded_tensor_collectives() -> dict:
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_interactive.fsdp._sharded_tensor import to_dtensor_like

    world = dist.get_world_size()
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    value = empty(spec, 4, 3)
    value.local_shards()[0].tensor.fill_(1.0 + dist.get_rank())
    mesh = init_device_mesh("cpu", (world,))
    matching = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    other_layout = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(1)])
    out = {}
    for name, like in (("matching", matching), ("other layout", other_layout)):
        asked: list = []
        reached = first_collective(lambda like=like: to_dtensor_like(value, like), asked)
        default = [g is None or g is dist.group.WORLD for g in asked]
        out[name] = (reached.name, reached.devices, default)
    # And for real, on gloo: the values land where the parameter's layout wants them.
    real = to_dtensor_like(value, other_layout).full_tensor()
    out["values"] = real[:, 0].tolist()
    return out


def test_sharded_tensor_loads_talk_on_the_groups_device_not_the_shards(ranks2):
    for result in ranks2.run(sharded_tensor_collectives):
        for name in ("matching", "other layout"):
            collective, devices, asked = result[name]
            assert (collective, devices) == ("all_reduce", ["meta"]), (name, result[name])
            assert asked == [True], asked  # the ShardedTensor's group: the default one
        assert result["values"] == [1.0, 1.0, 2.0, 2.0]


def rank0_optimizer_load_collective() -> dict:
    from fsdp_interactive.fsdp import FullOptimStateDictConfig, StateDictType
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model, optim = _offloaded()
    config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None, config):
        osd = FSDP.optim_state_dict(model, optim)
        reached = first_collective(lambda: FSDP.optim_state_dict_to_load(model, optim, osd))
    return {"collective": reached.name, "devices": reached.devices}


def test_rank0_optimizer_state_is_broadcast_on_the_groups_device(ranks2):
    for result in ranks2.run(rank0_optimizer_load_collective):
        assert result == {"collective": "broadcast", "devices": ["meta"]}


def comm_device_rules() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_interactive.fsdp import _comm_device
    from fsdp_interactive.fsdp._comm_device import comm_device

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {
        "gloo default group": comm_device(None),
        "gloo group": comm_device(dist.group.WORLD),
        "cpu mesh": comm_device(mesh),
        "DTensor on a cpu mesh": comm_device(distribute_tensor(torch.ones(4), mesh, [Shard(0)])),
    }
    # NCCL, as torch reports it (collective device type "cuda"), on CUDA device 3.
    with (
        mock.patch.object(_comm_device, "collective_device_type", lambda group=None: "cuda"),
        mock.patch.object(torch.cuda, "current_device", lambda: 3),
    ):
        out["nccl group"] = comm_device(None)
        # A property of the class on recent torch, an attribute of the instance on 2.9.
        if isinstance(getattr(type(mesh), "device_type", None), property):
            as_cuda = mock.patch.object(
                type(mesh), "device_type", new=mock.PropertyMock(return_value="cuda")
            )
        else:
            as_cuda = mock.patch.object(mesh, "device_type", "cuda")
        with as_cuda:
            out["cuda mesh"] = comm_device(mesh)
    return {k: str(v) for k, v in out.items()}


def test_comm_device_rules(ranks2):
    for result in ranks2.run(comm_device_rules):
        assert result == {
            "gloo default group": "cpu",
            "gloo group": "cpu",
            "cpu mesh": "cpu",
            "DTensor on a cpu mesh": "cpu",
            "nccl group": "cuda:3",
            "cuda mesh": "cuda:3",
        }


def test_comm_device_without_a_process_group_is_the_cpu():
    from fsdp_interactive.fsdp._comm_device import comm_device

    assert not dist.is_initialized()
    assert comm_device(None) == torch.device("cpu")


def gather_full_values() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdp_interactive.fsdp._comm_device import gather_full

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(15.0).reshape(5, 3)
    sharded = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    replicated = distribute_tensor(full, mesh, [Replicate()])
    gathered = gather_full(sharded, to_cpu=True)
    whole = gather_full(replicated, to_cpu=False)
    local = replicated.to_local()
    return {
        "sharded": torch.equal(gathered, full),
        "plain": type(gathered) is torch.Tensor and not gathered.requires_grad,
        "replicated": torch.equal(whole, full),
        "a copy, not the shard": whole.untyped_storage().data_ptr()
        != local.untyped_storage().data_ptr(),
    }


def test_gather_full_gives_a_detached_copy_of_the_whole_tensor(ranks2):
    for result in ranks2.run(gather_full_values):
        assert all(result.values()), result
