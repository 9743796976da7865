"""Notebook side: magics, widgets and plots over the rank pool.

Nothing here initializes CUDA in the kernel; everything shown is asked of the ranks
through the probes in :mod:`fsdp_interactive.inspect`.

* ``%load_ext fsdp_interactive`` registers ``%fsdp``, ``%%fsdp`` and ``%fsdp_auto``
  (:mod:`fsdp_interactive.notebook.magics`); ``current_pool()`` is the pool they started.
* ``RankModel(pool, model="model", optimizer=None, recorder=None)``: the probes as plain
  calls on a model living on the ranks. Input the ranks cannot take (a variable they do
  not have, an unknown parameter name) raises ``ProbeInputError`` (``UnknownNameError``
  for a name) in the kernel, naming the close matches.
* Views, each a widget in a live kernel and text/HTML elsewhere: ``LayoutView``,
  ``SummonPanel``, ``GradNormView``, ``GradNormMonitor``, ``Dashboard``,
  ``CheckpointPanel``, ``SnapshotPanel`` (snapshots in host memory and Recover), and
  ``ProbeView`` for any probe of ``fsdp_interactive.inspect.PROBES`` (``RankModel.ask``).
* :mod:`fsdp_interactive.notebook.plots`: the matplotlib figures from plain records.

Names are imported lazily so that loading the magics does not import matplotlib.
"""

from __future__ import annotations

from fsdp_interactive._lazy_exports import lazy_exports

_LAZY = {
    "current_pool": "fsdp_interactive.notebook.magics",
    "RankModel": "fsdp_interactive.notebook.rank_model",
    "LayoutView": "fsdp_interactive.notebook.layout_view",
    "SummonPanel": "fsdp_interactive.notebook.summon_panel",
    "GradNormView": "fsdp_interactive.notebook.grad_norm_view",
    "GradNormMonitor": "fsdp_interactive.notebook.monitor",
    "Dashboard": "fsdp_interactive.notebook.dashboard",
    "CheckpointPanel": "fsdp_interactive.notebook.checkpoint_panel",
    "SnapshotPanel": "fsdp_interactive.notebook.snapshot_panel",
    "ProbeView": "fsdp_interactive.notebook.probe_view",
    "ProbeInputError": "fsdp_interactive.notebook._probe_input",
    "UnknownNameError": "fsdp_interactive.notebook._probe_input",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
