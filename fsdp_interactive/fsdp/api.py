"""FSDP1's enums and configuration classes, re-exported from torch.

These are *torch's own* classes (``torch.distributed.fsdp.api``), not copies: FSDP1 code that
changes only its ``FullyShardedDataParallel`` import keeps passing ``torch.distributed.fsdp``
enums and configs, and :class:`~fsdp_interactive.fsdp.FullyShardedDataParallel` accepts them
because they are the same objects. The package :mod:`fsdp_interactive.fsdp` exports
every name of this module's ``__all__`` (this list is the one list of them); this module
mirrors ``torch.distributed.fsdp.api`` (plus ``OptimStateKeyType``, which torch keeps in
``fully_sharded_data_parallel``) for code that imports the enums by that path.
"""

from __future__ import annotations

from torch.distributed.fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.fsdp.fully_sharded_data_parallel import OptimStateKeyType

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
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
