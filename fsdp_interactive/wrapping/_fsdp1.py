"""torch FSDP1's flat parameters, read from their own bookkeeping (rank side).

Each torch ``FullyShardedDataParallel`` module (a *unit*) flattens the parameters it
manages into one ``FlatParameter`` and keeps, per original parameter, its FQN below the
unit, its shape and where this rank's run of its elements lies (see
:func:`fsdp_interactive._torch_compat.fsdp1_pieces`). The unit shards over its
``process_group`` (``FULL_SHARD``, ``SHARD_GRAD_OP``), over the intra-node group while
replicating over the inter-node one (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``), or not at
all (``NO_SHARD``: every rank holds the whole flat parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy

from fsdp_interactive._torch_compat import fsdp1_flat_param, fsdp1_pieces, fsdp1_replicate_group
from fsdp_interactive.fsdp.fully_sharded_data_parallel import FSDP_WRAPPED_MODULE
from fsdp_interactive.wrapping._param import FlatShard, world
from fsdp_interactive.wrapping._path_cleaner import PathCleaner
from fsdp_interactive.wrapping._refusal import UnsupportedWrapping


@dataclass(frozen=True)
class Fsdp1Original:
    """One original parameter of a torch FSDP1 unit: its FQN below the unit's wrapped
    module, its shape, the unit's clean and wrapped paths, its own clean name and where this
    rank keeps it."""

    fqn_in_unit: str
    shape: tuple[int, ...]
    unit: str
    unit_path: str
    clean_name: str
    shard: FlatShard

    @property
    def wrapped_name(self) -> str:
        """Where FSDP1 with ``use_orig_params=True`` would register it."""
        return _wrapped_name(self.unit_path, self.fqn_in_unit)


@dataclass
class Fsdp1Index:
    """The torch FSDP1 units of a model: each flat parameter's originals (by the flat
    parameter's id) and, under ``use_orig_params=True``, each original by its own id."""

    by_flat_param: dict[int, list[Fsdp1Original]]
    by_original: dict[int, Fsdp1Original]

    def __bool__(self) -> bool:
        return bool(self.by_flat_param)


def index_fsdp1(modules: list[tuple[str, nn.Module]], cleaner: PathCleaner) -> Fsdp1Index:
    """The :class:`Fsdp1Index` of every torch FSDP1 unit among ``modules`` (a root's
    ``named_modules()``; no communication).

    ``UnsupportedWrapping`` for a unit whose ranks, with their replicas, do not make up the
    default group (each piece's copies are counted over it).
    """
    index = Fsdp1Index({}, {})
    world_size = world()[1]
    for path, module in modules:
        if not isinstance(module, TorchFSDP):
            continue
        held = fsdp1_flat_param(module)
        if held is None:
            continue
        flat_param, local_shard = held
        shard_group, replicas = _groups(module, path, world_size)
        unit = cleaner.clean(path)
        originals = []
        for fqn, shape, offset, start, length, original in fsdp1_pieces(flat_param):
            shard = FlatShard(
                module,
                flat_param,
                local_shard,
                offset,
                start,
                length,
                original,
                shard_group,
                replicas,
            )
            wrapped = _wrapped_name(path, fqn)
            entry = Fsdp1Original(
                fqn, tuple(int(s) for s in shape), unit, path, cleaner.clean(wrapped), shard
            )
            originals.append(entry)
            if original is not None:
                index.by_original[id(original)] = entry
        index.by_flat_param[id(flat_param)] = originals
    return index


def _wrapped_name(unit_path: str, fqn_in_unit: str) -> str:
    inner = f"{unit_path}.{FSDP_WRAPPED_MODULE}" if unit_path else FSDP_WRAPPED_MODULE
    return f"{inner}.{fqn_in_unit}"


def _groups(module: nn.Module, path: str, world_size: int) -> tuple[dist.ProcessGroup | None, int]:
    """(the group ``module`` shards over, ``None`` under NO_SHARD; ranks per piece)."""
    group = module.process_group
    size = dist.get_world_size(group) if world_size > 1 else 1
    if module.sharding_strategy == ShardingStrategy.NO_SHARD:
        shard_group, replicas = None, size
    else:
        replicate = fsdp1_replicate_group(module)
        shard_group = group
        replicas = dist.get_world_size(replicate) if replicate is not None else 1
    spans = size if shard_group is None else size * replicas
    if spans != world_size:
        raise UnsupportedWrapping(
            type(module).__name__,
            f"the torch FSDP1 unit {path or '(root)'!r} ({module.sharding_strategy.name}) "
            f"reduces gradients over {spans} of the {world_size} ranks of the default group, "
            "so the ranks' copies differ"
            + (
                " (FSDP1 runs HYBRID_SHARD with a one-rank shard group as NO_SHARD over that rank)"
                if shard_group is None and fsdp1_replicate_group(module) is not None
                else ""
            ),
        )
    return shard_group, replicas
