"""Models wrapped the ways users wrap them, and what each framework's own tools say of them.

Everything is module-level so it pickles into the rank processes. :func:`build` (on every
rank: a collective) wraps a :class:`tests.models.TinyLM` as one of :data:`CASES` and runs one
forward and backward on data that differs by rank (so gradients must be reduced to agree);
the :class:`Wrapped` it returns holds the model and the framework's truth:

* ``framework_norm()``: the global gradient norm by the framework's own ``clip_grad_norm_``
  (torch FSDP1's ``FSDP.clip_grad_norm_``, Fabric's ``clip_gradients``, accelerate's
  ``clip_grad_norm_``, ``torch.nn.utils.clip_grad_norm_`` for DDP and compiled models),
  with a max norm nothing reaches;
* ``full_params()``: clean FQN -> full tensor, gathered by the framework (torch FSDP1's
  ``summon_full_params``; torch's ``get_model_state_dict(full_state_dict=True)``
  elsewhere), in the framework's order;
* ``full_grads()``: clean FQN -> full gradient where the framework shows one per original
  parameter (torch FSDP1 with flat parameters shows none: ``{}``);
* ``local_data()``: what this rank stores, as the framework shows it publicly: each
  registered tensor under the set of clean names torch's state-dict helpers give it (one
  name; a torch FSDP1 flat parameter's originals), and whether it is a flat parameter.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.models import VOCAB, Block, TinyLM

FRAMEWORKS_ENV = "FSDPI_REQUIRE_FRAMEWORKS"
CHECKPOINTED = "_checkpoint_wrapped_module."
FSDP_LEVEL = "_fsdp_wrapped_module."
HUGE = 1e12

FSDP1_CASES = tuple(
    f"fsdp1-{params}-{strategy}"
    for params in ("flat", "orig")
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
)
CASES = (
    *FSDP1_CASES,
    "ddp",
    "compiled",
    "checkpointed",
    "checkpointed-fsdp1",
    "fabric-ddp",
    "fabric-fully_shard",
    "accelerate",
)
NEEDS = {"fabric-ddp": "lightning", "fabric-fully_shard": "lightning", "accelerate": "accelerate"}


def require_framework(case: str) -> None:
    """Skip a case whose framework is not installed (fail under ``FSDPI_REQUIRE_FRAMEWORKS=1``)."""
    package = NEEDS.get(case)
    if package is None or importlib.util.find_spec(package) is not None:
        return
    reason = f"{package} is not installed: pip install 'fsdp-interactive[frameworks]'"
    if os.environ.get(FRAMEWORKS_ENV) == "1":
        pytest.fail(f"{reason} ({FRAMEWORKS_ENV}=1 requires the framework tests to run)")
    pytest.skip(reason)


@dataclass
class Wrapped:
    model: nn.Module
    framework_norm: Callable[[], float]
    full_params: Callable[[], dict[str, torch.Tensor]]
    full_grads: Callable[[], dict[str, torch.Tensor]]
    local_data: Callable[[], list[tuple[frozenset[str], torch.Tensor, bool]]]


def tokens() -> torch.Tensor:
    """A batch that differs by rank."""
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    return torch.randint(0, VOCAB, (2, 5), generator=generator)


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def build(case: str) -> Wrapped:
    """``case`` built on every rank after one forward and backward (a collective)."""
    torch.manual_seed(0)
    base = TinyLM(n_blocks=2)
    if case.startswith("fsdp1-"):
        _, params, strategy = case.split("-")
        return _fsdp1(base, strategy, use_orig_params=params == "orig")
    if case == "checkpointed-fsdp1":
        _checkpoint_blocks(base)
        return _fsdp1(base, "FULL_SHARD", use_orig_params=False)
    if case in ("ddp", "compiled", "checkpointed"):
        if case == "checkpointed":
            _checkpoint_blocks(base)
        model: nn.Module = nn.parallel.DistributedDataParallel(base)
        if case == "compiled":
            model = torch.compile(model, backend="eager")
        loss_of(model(tokens())).backward()
        return _torch_truth(model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), HUGE))
    if case.startswith("fabric-"):
        return _fabric(base, case.removeprefix("fabric-"))
    if case == "accelerate":
        return _accelerate(base)
    raise ValueError(f"unknown case {case!r}")


def _checkpoint_blocks(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def _fsdp1(base: nn.Module, strategy: str, use_orig_params: bool) -> Wrapped:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    groups: dict[str, Any] = {}
    if strategy == "HYBRID_SHARD":
        # 2 x 2 at 4 ranks; 1 x 2 at 2 (a shard group of one rank makes torch FSDP1 fall
        # back to NO_SHARD over that one rank: no gradient reduction at all).
        shape = (dist.get_world_size() // 2, 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        # Both ways FSDP1 accepts: a 2-D mesh, and an (intra-node, inter-node) group pair.
        groups = (
            {"process_group": (mesh.get_group(1), mesh.get_group(0))}
            if use_orig_params
            else {"device_mesh": mesh}
        )
    model = FSDP(
        base,
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
        **groups,
    )
    loss_of(model(tokens())).backward()

    def summoned(with_grads: bool) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        with FSDP.summon_full_params(model, writeback=False, with_grads=with_grads):
            # Inside, FSDP1 names the original parameters without its own levels (a
            # checkpoint wrapper's it keeps where the wrapper is outside a unit: the state
            # dict's keys leave it out, as here).
            full = {
                name.replace(CHECKPOINTED, ""): (p.grad if with_grads else p).detach().clone()
                for name, p in model.named_parameters()
            }
        assert sorted(full) == sorted(get_model_state_dict(model)), "names differ from torch's"
        return full

    def local_data() -> list[tuple[frozenset[str], torch.Tensor, bool]]:
        # A flat parameter's originals: its FSDP1 unit's path, spelled clean (the wrapper
        # levels taken out by name), before each of its FQNs in the unit.
        originals = {id(p): p._fqns for p in model.parameters() if hasattr(p, "_fqns")}
        out = []
        for name, p in model.named_parameters():
            clean = name.replace(FSDP_LEVEL, "").replace(CHECKPOINTED, "")
            if id(p) in originals:
                unit = clean.removesuffix("_flat_param")
                names = {unit + fqn.replace(CHECKPOINTED, "") for fqn in originals[id(p)]}
            else:
                names = {clean}
            out.append((frozenset(names), p.detach().clone(), id(p) in originals))
        return out

    return Wrapped(
        model,
        lambda: float(model.clip_grad_norm_(HUGE)),
        lambda: summoned(False),
        lambda: summoned(True) if use_orig_params else {},
        local_data,
    )


def _torch_truth(
    model: nn.Module, norm: Callable[[], torch.Tensor], state_dict_of: nn.Module | None = None
) -> Wrapped:
    """Truth from torch's own state-dict helpers (full tensors and clean names)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from fsdp_interactive._torch_compat import get_fqns

    holder = state_dict_of if state_dict_of is not None else model

    def full() -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True)
        return {
            k: v.detach().clone() for k, v in get_model_state_dict(holder, options=options).items()
        }

    def grads() -> dict[str, torch.Tensor]:
        out = {}
        for name, p in holder.named_parameters():
            (clean,) = get_fqns(holder, name)
            grad = p.grad
            out[clean] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
        return out

    def local_data() -> list[tuple[frozenset[str], torch.Tensor, bool]]:
        return [
            (
                frozenset(get_fqns(holder, name)),
                (p.to_local() if isinstance(p, DTensor) else p).detach().clone(),
                False,
            )
            for name, p in holder.named_parameters()
        ]

    def total() -> float:
        value = norm()
        # Over DTensor gradients the total is a DTensor too, pending its reduction on older
        # torch releases (a Partial placement: float() would read this rank's part).
        return float(value.full_tensor() if isinstance(value, DTensor) else value)

    return Wrapped(model, total, full, grads, local_data)


def _fabric(base: nn.Module, strategy: str) -> Wrapped:
    from lightning import Fabric
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies import ModelParallelStrategy

    world = dist.get_world_size()
    if strategy == "fully_shard":

        def parallelize(module: nn.Module, device_mesh: Any) -> nn.Module:
            from torch.distributed.fsdp import fully_shard

            for block in module.blocks:
                fully_shard(block, mesh=device_mesh["data_parallel"])
            fully_shard(module, mesh=device_mesh["data_parallel"])
            return module

        chosen: Any = ModelParallelStrategy(
            parallelize, data_parallel_size=world, tensor_parallel_size=1
        )
    else:
        chosen = "ddp"
    fabric = Fabric(
        accelerator="cpu", devices=world, strategy=chosen, plugins=[LightningEnvironment()]
    )
    fabric.launch()  # the group exists: Fabric joins it and starts nothing
    module = fabric.setup_module(base)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.0))
    fabric.backward(loss_of(module(tokens())))
    truth = _torch_truth(
        module,
        lambda: fabric.clip_gradients(module, optimizer, max_norm=HUGE),
        state_dict_of=module.module,
    )
    # Fabric's own names: its state_dict() is the original module's.
    names = list(module.state_dict())
    full = truth.full_params
    truth.full_params = lambda: {name: full()[name] for name in names}
    return truth


def _accelerate(base: nn.Module) -> Wrapped:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(base)
    accelerator.backward(loss_of(model(tokens())))
    return _torch_truth(
        model, lambda: accelerator.clip_grad_norm_(model.parameters(), max_norm=HUGE)
    )


def flat_runs_in_order(local: torch.Tensor, runs: list[torch.Tensor]) -> bool:
    """Whether ``local`` is ``runs`` one after the other, with only zeros (padding) around
    and between them: how torch FSDP1 lays a rank's pieces out in its flat shard."""
    local = local.reshape(-1)
    position = 0
    for run in runs:
        length = run.numel()
        if not length:
            continue
        while not torch.equal(local[position : position + length], run):
            if position + length > local.numel() or local[position] != 0:
                return False
            position += 1
        position += length
    return bool((local[position:] == 0).all())
