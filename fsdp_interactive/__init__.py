"""fsdp_interactive: interactive distributed training with PyTorch FSDP in Jupyter.

The top-level names are imported lazily so that ``import fsdp_interactive`` (and
``%load_ext fsdp_interactive``) stays cheap in the notebook kernel:

* ``FullyShardedDataParallel`` and its enums/configs: torch FSDP1's API on ``fully_shard``
  (:mod:`fsdp_interactive.fsdp`), used on the ranks.
* ``Pool``: the ipyparallel engine pool, one ``torch.distributed`` rank per engine
  (:mod:`fsdp_interactive.pool`), used in the notebook kernel.
* ``breakpoint(rank=0, commands=None)``: inside a ``%%fsdp`` cell, stop one rank at the
  next line (the others wait) and debug it from the notebook's input box.
* ``snapshot(model=..., optimizer=..., **stateful)``: on the ranks, keep the training
  state in host memory (:mod:`fsdp_interactive.checkpoint`), to recover from a fault.
* ``attachable()``: in a training script, make this rank reachable from a notebook
  (:mod:`fsdp_interactive.attachable`; or run the script under
  ``-m fsdp_interactive.attachable``), and ``attach(...)``: in the notebook, attach to
  such a running job (an ``AttachedJob``, driven like a pool).
* ``job``: what a script exported from a notebook session (``%fsdp export``) calls on
  its ranks under torchrun (:mod:`fsdp_interactive.pool.rank._job`).
"""

from __future__ import annotations

from typing import Any

from fsdp_interactive._lazy_exports import lazy_exports

__version__ = "0.1.0"

_LAZY_EXPORTS = {
    "FullyShardedDataParallel": "fsdp_interactive.fsdp",
    "ShardingStrategy": "fsdp_interactive.fsdp",
    "BackwardPrefetch": "fsdp_interactive.fsdp",
    "CPUOffload": "fsdp_interactive.fsdp",
    "MixedPrecision": "fsdp_interactive.fsdp",
    "StateDictType": "fsdp_interactive.fsdp",
    "Pool": "fsdp_interactive.pool",
    "breakpoint": "fsdp_interactive.pool.rank._breakpoint",
    "snapshot": "fsdp_interactive.checkpoint",
    "attachable": "fsdp_interactive.attachable",
    "attach": "fsdp_interactive.pool",
    "job": "fsdp_interactive.pool.rank._job",
}

__all__ = [*_LAZY_EXPORTS, "__version__", "load_ipython_extension"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_EXPORTS)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext fsdp_interactive``: register the ``%fsdp`` / ``%%fsdp`` magics."""
    from fsdp_interactive.notebook.magics import load_ipython_extension as _load

    _load(ipython)
