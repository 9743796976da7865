"""torch FSDP1's public API (``FullyShardedDataParallel`` and its enums/configs) on
``torch.distributed.fsdp.fully_shard``.

FSDP1 code moves over by changing one import::

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

The enums and configs are torch's own classes, so ``torch.distributed.fsdp.ShardingStrategy``
and friends are accepted unchanged; auto-wrap policies live in :mod:`fsdp_interactive.fsdp.wrap`.
Rank side only: importing this module never touches CUDA.
"""

from __future__ import annotations

from fsdp_interactive._lazy_exports import public_names
from fsdp_interactive.fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_interactive.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]

__dir__ = public_names(__name__)
