"""Rank-side probes: what the ranks hold, as plain data.

Every probe runs on the ranks (through ``Pool.call`` or directly in training code) and
returns small dataclasses (exported here) that the notebook side renders.  Nothing here
imports IPython, ipywidgets or matplotlib.  Parameters are read through
:mod:`fsdp_interactive.wrapping`, so the probes take a model however it is wrapped (DTensor
models, torch FSDP1, DDP, compiled, checkpoint-wrapped, Lightning, accelerate) and accept
and report clean FQNs (the wrapped names are accepted too); a wrapping they do not
understand raises ``UnsupportedWrapping`` (exported here) naming the class.

* ``layout(model, optimizer=None)`` -> ``RankLayout`` (no communication); merge the
  per-rank answers with ``merge_layouts``.
* ``grad_norms(model, norm_type=2.0)`` -> ``GradNorms`` (one small all-reduce).
* ``summon_stats(model, fqn)`` -> ``TensorStats``; ``edit_param(model, fqn, expression)``
  writes an edited full parameter back (collectives over the mesh).
* ``memory()`` -> ``MemoryStats`` (no communication).
* ``PROBES``: the probes above, each declared once with its record type and how the
  ranks' answers combine (``RankModel.ask`` asks any of them from the kernel).
* ``clean_name(model, name)``: the clean FQN of a parameter or module named either way.
* ``plain_copy(value, max_bytes)``: a CPU copy of a (D)Tensor for the kernel, size-limited;
  its ``ValueError`` for a value over the limit contains ``TOO_LARGE``.
  ``full_param(model, fqn)``: one whole parameter as a CPU tensor, however it is wrapped.
* ``GradNormRecorder(model)``: per-step norms from a training loop.
* ``check_sources(namespace, sources)``: what is wrong with the variables a view names.
  An argument the caller got wrong raises ``ProbeInputError`` (a ``ValueError``), a name
  that is neither a parameter nor a module ``UnknownName`` (a ``KeyError``), each naming
  the close matches.
"""

from __future__ import annotations

from fsdp_interactive._lazy_exports import lazy_exports

# The records are plain dataclasses, imported at once: the kernel unpickles them. The
# probes (and the wrapping's refusal) import torch, so they are imported when first used
# (on the ranks): a kernel that shows a record never imports torch for it.
from fsdp_interactive.inspect._records import (
    NO_GRADIENTS,
    PROBES,
    GradNormRecord,
    GradNorms,
    MemoryStats,
    ModelLayout,
    ParamLayout,
    Probe,
    RankLayout,
    RankTotals,
    ShardSlice,
    TensorStats,
    combine_norms,
    find_spikes,
    merge_layouts,
    record_from_json,
    record_to_json,
)

_INSPECT = "fsdp_interactive.inspect"
#: Each name exported on first use, and the module it comes from: every probe of
#: ``PROBES``, and the helpers beside them.
_LAZY = {
    **{probe.name: probe.module for probe in PROBES.values()},
    "clean_name": f"{_INSPECT}._clean_name",
    "TOO_LARGE": f"{_INSPECT}._pull",
    "full_param": f"{_INSPECT}._pull",
    "plain_copy": f"{_INSPECT}._pull",
    "GradNormRecorder": f"{_INSPECT}._recorder",
    "UnsupportedWrapping": "fsdp_interactive.wrapping",
    "UnknownName": "fsdp_interactive.wrapping",
    "ProbeInputError": f"{_INSPECT}._inputs",
    "check_sources": f"{_INSPECT}._inputs",
}


#: Declared for the API reference (imported above from ``_records``):
NO_GRADIENTS: str
"""What a gradient-norm record (its ``repr``) and the views say before the first backward."""

PROBES: dict[str, Probe]
"""Every probe by name (:class:`Probe`: its module, record type and how the ranks'
answers combine): the one place a probe is declared; the package exports each, and
``RankModel.ask`` asks any of them on a pool's ranks."""

#: Declared for the API reference (the value comes from ``_pull`` when first used):
TOO_LARGE: str
"""The words in the ``ValueError`` of ``plain_copy`` and ``full_param`` for a value over
the size limit."""

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "NO_GRADIENTS",
    "PROBES",
    "TOO_LARGE",
    "GradNormRecord",
    "GradNormRecorder",
    "GradNorms",
    "MemoryStats",
    "ModelLayout",
    "ParamLayout",
    "Probe",
    "ProbeInputError",
    "RankLayout",
    "RankTotals",
    "ShardSlice",
    "TensorStats",
    "UnknownName",
    "UnsupportedWrapping",
    "check_sources",
    "clean_name",
    "combine_norms",
    "find_spikes",
    "full_param",
    "merge_layouts",
    "plain_copy",
    "record_from_json",
    "record_to_json",
]
__all__ += PROBES  # every declared probe, exported when first used
