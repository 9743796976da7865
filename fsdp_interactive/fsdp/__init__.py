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
from fsdp_interactive.fsdp import api

# The enums and configs: the one list of them is api.__all__ (api.py mirrors
# torch.distributed.fsdp.api, which FSDP1 code may import by that path too).
from fsdp_interactive.fsdp.api import *  # noqa: F403
from fsdp_interactive.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel"]
__all__ += api.__all__

__dir__ = public_names(__name__)
