"""The wrappings users bring, built on the ranks around the same :class:`tests.models.TinyLM`
(module-level, so that they pickle into rank processes and a pool cell can import them).

:data:`WRAPPINGS` names each: torch's own FSDP1 with flat parameters (``flat``) or original
ones (``orig``) under FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD (a device mesh of
(replicas, shards): (1, 2) on 2 ranks, (2, 2) on 4), DDP, ``fully_shard`` under
``torch.compile`` (the eager backend: the ``_orig_mod.`` wrapper without inductor's compile
time), ``fully_shard`` over activation-checkpoint wrappers, Lightning Fabric's
``ModelParallelStrategy`` (``fully_shard`` per block, ``_FabricModule`` around it), and
accelerate's FSDP2 (forced on CPU ranks, as docs/frameworks.md shows) and its CPU default
(DDP).

:func:`build` returns the model and its optimizer; :func:`train` runs steps on per-rank
batches; :func:`local_state` is what each rank holds (its shards of every parameter, its
optimizer state, its CPU random state) as CPU tensors, and :func:`digest` its SHA-256:
two are equal only when every byte is. :func:`full_state` gathers the model and optimizer
state whole, by clean names, with torch's own ``get_state_dict``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.models import VOCAB, Block, TinyLM

FSDP1 = [
    f"fsdp1-{params}-{strategy}"
    for params in ("flat", "orig")
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
]
WRAPPINGS = [*FSDP1, "ddp", "compiled", "checkpointed", "fabric", "accelerate", "accelerate-ddp"]
LR = 1e-2


def _fsdp1(model: nn.Module, params: str, strategy: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    extra: dict[str, Any] = {}
    if strategy == "HYBRID_SHARD":
        world = dist.get_world_size()
        replicas = 2 if world >= 4 else 1
        extra["device_mesh"] = init_device_mesh("cpu", (replicas, world // replicas))
    return FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=params == "orig",
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        **extra,
    )


def shard_blocks(model: TinyLM, mesh: Any = None) -> TinyLM:
    """``fully_shard`` on every block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fabric_parallelize(model: TinyLM, mesh: Any) -> TinyLM:
    return shard_blocks(model, mesh["data_parallel"])


def _fabric(model: TinyLM) -> tuple[nn.Module, torch.optim.Optimizer]:
    import lightning as L
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies import ModelParallelStrategy

    world = dist.get_world_size()
    strategy = ModelParallelStrategy(
        _fabric_parallelize, data_parallel_size=world, tensor_parallel_size=1
    )
    fabric = L.Fabric(
        accelerator="cpu", devices=world, strategy=strategy, plugins=[LightningEnvironment()]
    )
    fabric.launch()
    wrapped = fabric.setup_module(model)
    return wrapped, fabric.setup_optimizers(torch.optim.AdamW(wrapped.parameters(), lr=LR))


def _accelerate(model: TinyLM, fsdp2: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    # accelerate's state is one per process: reset it, so that a process that built one
    # Accelerator (an earlier test on the same ranks) can build another of another kind.
    AcceleratorState._reset_state(True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    if fsdp2:  # on CPU ranks accelerate picks DDP (MULTI_CPU); FSDP is its GPU-only path
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))


def build(kind: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The seeded :class:`TinyLM` wrapped as ``kind`` (one of :data:`WRAPPINGS`, or
    ``fully_shard``), and an AdamW over it."""
    torch.manual_seed(seed)
    model = TinyLM()
    if kind.startswith("fsdp1-"):
        _, params, strategy = kind.split("-")
        wrapped: nn.Module = _fsdp1(model, params, strategy)
    elif kind == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    elif kind == "compiled":
        wrapped = torch.compile(shard_blocks(model), backend="eager")
    elif kind == "checkpointed":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        wrapped = shard_blocks(model)
    elif kind == "fully_shard":
        wrapped = shard_blocks(model)
    elif kind == "fabric":
        return _fabric(model)
    elif kind in ("accelerate", "accelerate-ddp"):
        return _accelerate(model, fsdp2=kind == "accelerate")
    else:
        raise ValueError(f"unknown wrapping {kind!r}")
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=LR)


def train(model: nn.Module, optim: torch.optim.Optimizer, first: int, steps: int) -> None:
    """``steps`` AdamW steps from ``first`` on, each rank on its own batch."""
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        tokens = torch.randint(0, VOCAB, (2, 8), generator=gen)
        logits = model(tokens)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optim.step()
        optim.zero_grad()


def _local(value: torch.Tensor) -> torch.Tensor:
    value = value.to_local() if isinstance(value, DTensor) else value
    return value.detach().cpu().clone()


def local_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What this rank holds, by the wrapped names: its shard of every parameter (a flat
    parameter's local shard for torch FSDP1), its optimizer state, its CPU random state."""
    out = {"rng": torch.get_rng_state()}
    for name, param in model.named_parameters():
        out[f"param:{name}"] = _local(param)
        for key, value in optim.state.get(param, {}).items():
            out[f"optim:{name}:{key}"] = _local(value)
    return out


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    """SHA-256 of :func:`local_state`: names, shapes, dtypes and bytes, in name order (a
    loaded optimizer may hold its state's keys in another order)."""
    sha = hashlib.sha256()
    for name, value in sorted(local_state(model, optim).items()):
        sha.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
        sha.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state gathered whole by torch's ``get_state_dict``, keyed by
    clean names; each parameter group's names sorted (torch FSDP1 lists a flat parameter's
    originals in its own order)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True)
    )
    for group in optim_sd["param_groups"]:
        group["params"] = sorted(group["params"])
    return {"model": model_sd, "optim": optim_sd}


def differences(expected: Any, got: Any, path: str = "") -> list[str]:
    """Where two nested states differ (``torch.equal`` for tensors, ``==`` otherwise)."""
    if isinstance(expected, dict) and isinstance(got, dict):
        if set(expected) != set(got):
            return [f"{path}: keys {sorted(set(expected) ^ set(got))}"]
        return [d for k in expected for d in differences(expected[k], got[k], f"{path}.{k}")]
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(expected) != len(got):
            return [f"{path}: {len(expected)} items, {len(got)} items"]
        pairs = enumerate(zip(expected, got, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        return [] if torch.equal(expected, got) else [path]
    return [] if expected == got else [f"{path}: {expected!r} != {got!r}"]
