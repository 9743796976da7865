"""Every entry of ``fsdp_interactive._torch_compat`` resolves and does its job on the running
torch (``tests/test_torch_compat_rules.py``: no module of the package reaches a private
torch name except through it, and the admitted torch range is the checked one).

Run on each torch CI covers (``make test``, ``make test-torch TORCH_VERSION=...``): a torch
release that moves a private name fails here, in the test named after the entry.
"""

from __future__ import annotations

import functools
import inspect
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

from fsdp_interactive import _torch_compat as compat

# ---------------------------------------------------------------------------- torch core


def test_flatten_dense_tensors_round_trips():
    tensors = [torch.arange(3.0), torch.ones(2, 2)]
    flat = compat.flatten_dense_tensors(tensors)
    assert flat.shape == (7,)
    back = compat.unflatten_dense_tensors(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))


def test_foreach_norm_matches_vector_norm_and_takes_a_dtype():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([1.0, 1.0, 1.0, 1.0])]
    for ord_ in (2.0, 1.0, float("inf")):
        got = compat.foreach_norm(tensors, ord_)
        assert isinstance(got, list)
        want = [torch.linalg.vector_norm(t, ord_) for t in tensors]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    wide = compat.foreach_norm([t.half() for t in tensors], 2.0, dtype=torch.float64)
    assert [float(n) for n in wide] == [5.0, 2.0] and wide[0].dtype == torch.float64


def test_map_tree_maps_nested_leaves():
    assert compat.map_tree(lambda x: x * 2, {"a": [1, (2, 3)]}) == {"a": [2, (4, 6)]}


def test_flight_recorder_dump_takes_three_flags_and_returns_a_pickled_dict():
    dump = compat.flight_recorder_dump()
    assert dump is not None, f"torch {torch.__version__} has no flight recorder dump"
    trace = pickle.loads(dump(True, False, False))
    assert isinstance(trace["entries"], list)
    assert "version" in trace


def _collective_device_types() -> dict:
    import torch.distributed as dist

    subgroup = dist.new_group(backend="gloo")
    return {
        "default": compat.collective_device_type(),
        "world": compat.collective_device_type(dist.group.WORLD),
        "subgroup": compat.collective_device_type(subgroup),
    }


def test_collective_device_type_of_gloo_groups_is_the_cpu(ranks2):
    for r in ranks2.run(_collective_device_types):
        assert r == {"default": "cpu", "world": "cpu", "subgroup": "cpu"}


def test_nccl_flight_recorder_dump_reads_the_recorder_nccl_records_into():
    dump = compat.nccl_flight_recorder_dump()
    c10d = torch._C._distributed_c10d
    if not torch.distributed.is_nccl_available():
        assert dump is None  # a CPU build: no NCCL, no NCCL recorder
        return
    assert dump is c10d._dump_nccl_trace and dump is not compat.flight_recorder_dump()
    trace = pickle.loads(dump(True, False, False))  # readable without a GPU or a group
    assert isinstance(trace["entries"], list) and "version" in trace


def test_extend_nccl_timeouts_is_a_no_op_without_nccl_groups_and_takes_seconds():
    from torch.distributed import distributed_c10d

    parameters = inspect.signature(distributed_c10d._add_ephemeral_timeout_for_all_pgs).parameters
    assert list(parameters) == ["timeout"]
    compat.extend_nccl_timeouts(2.5)  # no group at all
    compat.extend_nccl_timeouts(0)
    calls = []
    original = distributed_c10d._add_ephemeral_timeout_for_all_pgs
    try:
        distributed_c10d._add_ephemeral_timeout_for_all_pgs = calls.append
        compat.extend_nccl_timeouts(1.5)
        compat.extend_nccl_timeouts(-1)
    finally:
        distributed_c10d._add_ephemeral_timeout_for_all_pgs = original
    assert [c.total_seconds() for c in calls] == [1.5]
    if torch.distributed.is_nccl_available():
        assert hasattr(torch.distributed.ProcessGroupNCCL, "_add_ephemeral_timeout")


def test_cuda_device_count_without_init_leaves_cuda_uninitialised():
    count = compat.cuda_device_count_without_init()
    if torch.version.cuda is None:
        assert count == 0
    else:  # a CUDA build: NVML answers (a GPU host) or cannot (None: count another way)
        assert (count is None or count >= 0) and callable(torch.cuda._device_count_nvml)
    assert not torch.cuda.is_initialized()


# ---------------------------------------------------------------------------- nn.Module


class _Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.register_buffer("b", torch.zeros(2))
        self.child = nn.Linear(2, 2)


def test_module_slots_are_the_live_registries():
    module = _Parent()
    new_param = nn.Parameter(torch.full((2,), 3.0))
    compat.parameter_slots(module)["w"] = new_param
    assert module.w is new_param and dict(module.named_parameters())["w"] is new_param
    new_buffer = torch.ones(2)
    compat.buffer_slots(module)["b"] = new_buffer
    assert module.b is new_buffer and dict(module.named_buffers())["b"] is new_buffer
    new_child = nn.Linear(2, 2)
    compat.submodule_slots(module)["child"] = new_child
    assert module.child is new_child and list(module.children()) == [new_child]
    assert set(compat.parameter_slots(module)) == {"w"}
    assert set(compat.buffer_slots(module)) == {"b"}


def test_submodule_slots_of_a_module_before_its_init_is_empty():
    assert compat.submodule_slots(nn.Linear.__new__(nn.Linear)) == {}


def test_move_own_states_leaves_children_alone():
    module = _Parent()
    child_weight = module.child.weight
    compat.move_own_states(module, torch.device("meta"))
    assert module.w.device.type == module.b.device.type == "meta"
    assert module.child.weight is child_weight and child_weight.device.type == "cpu"


def test_module_hook_dicts_are_every_hook_registry_of_a_module():
    """A rollback restores these; a registry torch adds would otherwise be left out."""
    registries = {k for k, v in vars(nn.Linear(1, 1)).items() if isinstance(v, dict)}
    assert registries == {*compat.MODULE_HOOK_DICTS, "_parameters", "_buffers", "_modules"}


def test_extra_state_key_suffix_is_the_state_dict_key_of_extra_state():
    class WithExtra(nn.Module):
        def get_extra_state(self):
            return {"n": 1}

        def set_extra_state(self, state):
            pass

    assert list(WithExtra().state_dict()) == [compat.EXTRA_STATE_KEY_SUFFIX]


# ---------------------------------------------------------------------------- DTensor


# ---------------------------------------------------------------------------- FSDP1 names


def test_policy_is_the_base_of_torchs_policies_and_runs_them():
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    assert issubclass(ModuleWrapPolicy, compat.Policy)
    assert issubclass(CustomPolicy, compat.Policy)
    root = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    chosen = compat.run_policy(ModuleWrapPolicy({nn.Linear}), root, set(), {"x": 1})
    assert {root[0], root[2]} <= set(chosen) and root[1] not in chosen
    assert chosen[root[0]] == {"x": 1}


def test_callable_policy_helpers():
    policy = functools.partial(
        compat.or_policy,
        policies=[
            functools.partial(compat.wrap_module_cls_individually, module_classes=(nn.Linear,))
        ],
    )
    assert policy(nn.Linear(1, 1), recurse=False, nonwrapped_numel=0)
    assert not policy(nn.ReLU(), recurse=False, nonwrapped_numel=0)


def test_mixed_precision_override_helpers():
    from torch.distributed.fsdp.api import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    classes = compat.module_classes_without_mixed_precision(
        MixedPrecision(param_dtype=torch.bfloat16)
    )
    assert any(issubclass(nn.BatchNorm1d, c) for c in classes)
    root = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    chosen = compat.run_policy(ModuleWrapPolicy({nn.Linear}), root, set(), {})
    chosen = compat.run_mixed_precision_override_policy(root, classes, set(), {}, chosen)
    assert chosen[root[1]]["mixed_precision"] is None
    overridden = compat.override_module_mixed_precision(root, classes)
    assert overridden == {nn.BatchNorm1d}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.warn_on_overridden_mixed_precision(overridden)
    assert any("BatchNorm1d" in str(w.message) for w in caught)


def test_hybrid_shard_zero2_is_a_sharding_strategy():
    from torch.distributed.fsdp.api import ShardingStrategy

    assert compat.HYBRID_SHARD_ZERO2 in ShardingStrategy
    assert compat.HYBRID_SHARD_ZERO2 not in (
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy.FULL_SHARD,
    )


@pytest.mark.parametrize(
    ("hook", "parameters"),
    [
        ("allreduce_hook", ["state", "grad"]),
        ("reduce_scatter_hook", ["state", "grad", "output"]),
        ("fp16_compress_hook", ["state", "grad", "output"]),
        ("bf16_compress_hook", ["state", "grad", "output"]),
    ],
)
def test_default_comm_hooks_have_fsdp1s_signatures(hook, parameters):
    assert list(inspect.signature(getattr(compat.default_hooks, hook)).parameters) == (parameters)
    assert inspect.isclass(compat.default_hooks.DefaultState)


def test_activation_wrapper_keeps_the_module_under_its_attribute():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = nn.Linear(2, 2)
    wrapped = checkpoint_wrapper(inner)
    assert isinstance(wrapped, compat.ActivationWrapper)
    assert getattr(wrapped, compat.CHECKPOINT_WRAPPED_MODULE) is inner
    assert dict(wrapped.named_children()) == {compat.CHECKPOINT_WRAPPED_MODULE: inner}


# ---------------------------------------------------------------------------- fully_shard


def test_reduce_scatter_protocol_matches_the_hook_runner():
    """fully_shard calls a custom reduce-scatter with these keywords."""
    from fsdp_interactive.fsdp._comm_hooks import HookReduceScatter

    call = inspect.signature(compat.ReduceScatter.__call__).parameters
    assert list(call) == ["self", "output_tensor", "input_tensor", "group", "op", "async_op"]
    assert list(inspect.signature(HookReduceScatter.__call__).parameters) == list(call)
    allocate = inspect.signature(compat.ReduceScatter.allocate).parameters
    assert list(allocate) == ["self", "size", "dtype", "device"]


def _fully_shard_probe() -> dict:
    """On each rank: what the fully_shard entries read from a two-level model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    seen_in_forward: list[str] = []

    class Leaf(nn.Linear):
        def forward(self, x):
            seen_in_forward.append(compat.training_state_name(self))
            return super().forward(x)

    torch.manual_seed(0)
    leaf = Leaf(3, 5)  # weight (5, 3): 3 rows on rank 0, 2 on rank 1, padded to 3
    root = nn.Sequential(leaf)
    fully_shard(leaf)
    fully_shard(root)
    root(torch.ones(1, 3)).sum().backward()

    weight, bias = leaf.weight, leaf.bias
    local = compat.local_tensor(weight)
    plain = torch.ones(2)
    (group,) = compat.fsdp_param_groups(leaf)
    mesh = weight.device_mesh
    result = {
        "root_groups": len(compat.fsdp_param_groups(root)),
        "has_sharded_params": (compat.has_sharded_params(root), compat.has_sharded_params(leaf)),
        "group_params_are_the_leafs": [p.sharded_param for p in group.fsdp_params]
        == [weight, bias],
        "padded": compat.padded_shard_numels(root) == {id(weight): 9, id(bias): 3},
        "idle": compat.training_state_name(leaf),
        "in_forward": seen_in_forward,
        "local_is_the_stored_shard": type(local) is torch.Tensor
        and local.data_ptr() == weight.to_local().data_ptr()
        and local.shape == weight.to_local().shape,
        "plain_passes_through": compat.local_tensor(plain) is plain,
        "here": compat.local_shape_and_offset(weight.shape, mesh, weight.placements),
        "at": [
            compat.local_shape_and_offset(weight.shape, mesh, weight.placements, [c])
            for c in (0, 1)
        ],
        "rank": rank,
    }
    old = group.mesh_info
    compat.reduce_over_shard_dim_only(leaf)
    result["shard_only"] = (
        group.mesh_info is not old
        and group.mesh_info.mesh is old.mesh
        and group.mesh_info.shard_mesh_dim == old.shard_mesh_dim
        and group.post_forward_mesh_info in (None, group.mesh_info)
    )
    return result


def test_fully_shard_state_entries(ranks2):
    for r in ranks2.run(_fully_shard_probe):
        assert r["root_groups"] == 0  # the root's only parameters belong to the leaf
        assert r["has_sharded_params"] == (False, True)
        assert r["group_params_are_the_leafs"]
        assert r["padded"]
        assert r["idle"] == "IDLE"
        assert r["in_forward"] == ["FORWARD"]
        assert r["local_is_the_stored_shard"]
        assert r["plain_passes_through"]
        assert r["here"] == (((3, 3), (0, 0)) if r["rank"] == 0 else ((2, 3), (3, 0)))
        assert r["at"] == [((3, 3), (0, 0)), ((2, 3), (3, 0))]
        assert r["shard_only"]


def _sharded_tensor_probe() -> dict:
    """On each rank: a ShardedTensor over the default group and the entries that read it."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    world = dist.get_world_size()
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    value = empty(spec, 4, 3)
    group = compat.sharded_tensor_group(value)
    return {
        "is_sharded_tensor": isinstance(value, compat.ShardedTensor),
        "group_is_the_world": group is None or dist.get_world_size(group) == world,
        "local_rows": value.local_shards()[0].tensor.shape[0],
    }


def test_sharded_tensor_entries(ranks2):
    for r in ranks2.run(_sharded_tensor_probe):
        assert r == {"is_sharded_tensor": True, "group_is_the_world": True, "local_rows": 2}


def _fsdp1_probe(use_orig_params: bool) -> dict:
    """On each rank: torch FSDP1 over uneven shapes, read through the FSDP1 entries and
    compared with what FSDP1's own summon_full_params shows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    inner = FSDP(nn.Linear(3, 5), device_id=cpu, use_orig_params=use_orig_params)
    model = FSDP(
        nn.Sequential(inner, nn.Linear(5, 2)), device_id=cpu, use_orig_params=use_orig_params
    )
    model(torch.randn(4, 3)).sum().backward()
    flat, local = compat.fsdp1_flat_param(inner)
    pieces = compat.fsdp1_pieces(flat)
    with FSDP.summon_full_params(model, writeback=False):
        full = {name: p.detach().reshape(-1).clone() for name, p in inner.named_parameters()}
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("r", "s"))
    hybrid = FSDP(
        nn.Linear(2, 2),
        device_id=cpu,
        device_mesh=mesh,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
    )
    registered = dict(inner.named_parameters())
    before_forward = compat.fsdp1_flat_param(hybrid)
    return {
        "flat_is_flat": isinstance(flat, compat.FlatParameter),
        "names": [(fqn, tuple(shape)) for fqn, shape, *_ in pieces],
        "pieces_hold_the_summoned": all(
            torch.equal(local[offset : offset + n], full[fqn][start : start + n])
            for fqn, _, offset, start, n, _ in pieces
        ),
        "held": sum(n for *_, n, _ in pieces),
        "originals": [
            original is registered.get(f"_fsdp_wrapped_module.{fqn}")
            if use_orig_params
            else original is None
            for fqn, *_, original in pieces
        ],
        "root_holds_its_own": compat.fsdp1_flat_param(model) is not None,
        "before_forward": before_forward[1] is before_forward[0].data
        or torch.equal(before_forward[1], before_forward[0].data),
        "replicate": (
            compat.fsdp1_replicate_group(inner),
            dist.get_world_size(compat.fsdp1_replicate_group(hybrid)),
        ),
        "managed": (
            compat.is_fsdp1_managed(flat),
            all(compat.is_fsdp1_managed(p) for p in registered.values()),
            compat.is_fsdp1_managed(torch.zeros(1)),
        ),
    }


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_flat_parameter_entries(ranks2, use_orig_params):
    held = 0
    for r in ranks2.run(_fsdp1_probe, use_orig_params):
        assert r["flat_is_flat"] and r["pieces_hold_the_summoned"]
        assert r["names"] == [("weight", (5, 3)), ("bias", (5,))]
        assert r["originals"] == [True, True]
        assert r["root_holds_its_own"]  # the root manages the second Linear itself
        assert r["before_forward"]
        assert r["replicate"] == (None, 1)
        assert r["managed"] == (True, True, False)
        held += r["held"]
    assert held == 20  # every element on exactly one of the 2 ranks


def test_compiled_module_inner_finds_the_compiled_module_without_importing_dynamo():
    import subprocess
    import sys

    linear = nn.Linear(2, 2)
    assert compat.compiled_module_inner(linear) is None
    assert compat.compiled_module_inner(torch.compile(linear, backend="eager")) is linear
    code = (
        "import sys, torch, fsdp_interactive._torch_compat as c\n"
        "c.compiled_module_inner(torch.nn.Linear(1, 1))\n"
        "print('torch._dynamo.eval_frame' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_version_counter_counts_in_place_writes_through_views():
    tensor = torch.zeros(4)
    before = compat.version_counter(tensor)
    tensor[1:3].add_(1.0)
    tensor.copy_(torch.ones(4))
    assert compat.version_counter(tensor) == before + 2
    assert compat.version_counter(tensor[:2]) == compat.version_counter(tensor)


# ---------------------------------------------------------------------------- checkpoints


def test_set_element_sets_a_nested_value():
    root = {"model": {"w": 1}, "optim": {"state": [0, 1]}}
    compat.set_element(root, ("optim", "state", 1), 5)
    compat.set_element(root, ("model", "w"), 2)
    assert root == {"model": {"w": 2}, "optim": {"state": [0, 5]}}


def test_get_fqns_steps_through_the_level_a_module_hides():
    from torch.distributed.checkpoint.state_dict import _get_fqns

    default = inspect.signature(_get_fqns).parameters["dsd_fqn_modifiers"].default
    assert default == compat.FQN_MODIFIERS_METHOD

    class Hiding(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def _fqn_modifiers(self):
            return {"weight": "inner", "bias": "inner"}

    # "weight" is not an attribute of Hiding: only the modifier leads to it.
    assert compat.get_fqns(nn.Sequential(Hiding()), "0.weight") == {"0.weight"}
    assert compat.get_fqns(nn.Sequential(nn.Linear(1, 1)), "0.weight") == {"0.weight"}


def test_dcp_metadata_private_globals_cover_what_dcp_pickles(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2, 3), "step": 3}, checkpoint_id=str(tmp_path))
    referenced: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            referenced.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / ".metadata", "rb") as f:
        Recording(f).load()
    private = {(m, n) for m, n in referenced if n.startswith("_")}
    assert private, "DCP's metadata refers to no private global: the entry can go"
    assert private <= set(compat.DCP_METADATA_PRIVATE_GLOBALS)
    for (module, name), obj in compat.DCP_METADATA_PRIVATE_GLOBALS.items():
        assert pickle.Unpickler(io.BytesIO()).find_class(module, name) is obj


def _partial_optimizer_state() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    model[0].bias.grad = None  # no state for this parameter
    optim.step()
    return model, optim, get_optimizer_state_dict(model, optim)


def test_set_optimizer_state_dict_admits_parameters_without_state():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, optim, state = _partial_optimizer_state()
    assert "0.bias" not in state["state"] and "0.weight" in state["state"]
    other = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    other_optim = torch.optim.Adam(other.parameters(), lr=0.5)
    compat.set_optimizer_state_dict(
        other, other_optim, state, options=StateDictOptions(strict=False)
    )
    assert other[0].bias not in other_optim.state
    assert len(other_optim.state) == len(optim.state) == 3
    for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
        if mine in optim.state:
            assert torch.equal(other_optim.state[theirs]["exp_avg"], optim.state[mine]["exp_avg"])
    assert other_optim.param_groups[0]["lr"] == 0.1


def test_torch_alone_admits_missing_state_exactly_where_the_entry_says():
    """The version boundary the entry relies on (torch 2.9 raises, 2.10+ passes over)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    _, _, state = _partial_optimizer_state()
    other = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    other_optim = torch.optim.Adam(other.parameters())
    load = functools.partial(
        set_optimizer_state_dict,
        other,
        other_optim,
        state,
        options=StateDictOptions(strict=False),
    )
    if compat._skips_missing_optimizer_state():
        load()
        assert other[0].bias not in other_optim.state
    else:
        with pytest.raises(KeyError, match=r"0\.bias"):
            load()
