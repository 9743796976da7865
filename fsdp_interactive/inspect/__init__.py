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
* ``clean_name(model, name)``: the clean FQN of a parameter or module named either way.
* ``plain_copy(value, max_bytes)``: a CPU copy of a (D)Tensor for the kernel, size-limited;
  its ``ValueError`` for a value over the limit contains ``TOO_LARGE``.
  ``full_param(model, fqn)``: one whole parameter as a CPU tensor, however it is wrapped.
* ``GradNormRecorder(model)``: per-step norms from a training loop.
"""

from fsdp_interactive.inspect._grad_norms import grad_norms
from fsdp_interactive.inspect._layout import layout
from fsdp_interactive.inspect._memory import memory
from fsdp_interactive.inspect._names import clean_name
from fsdp_interactive.inspect._pull import TOO_LARGE, full_param, plain_copy
from fsdp_interactive.inspect._recorder import GradNormRecorder
from fsdp_interactive.inspect._records import (
    GradNormRecord,
    GradNorms,
    MemoryStats,
    ModelLayout,
    ParamLayout,
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
from fsdp_interactive.inspect._summon import edit_param, summon_stats
from fsdp_interactive.wrapping import UnsupportedWrapping

__all__ = [
    "TOO_LARGE",
    "GradNormRecord",
    "GradNormRecorder",
    "GradNorms",
    "MemoryStats",
    "ModelLayout",
    "ParamLayout",
    "RankLayout",
    "RankTotals",
    "ShardSlice",
    "TensorStats",
    "UnsupportedWrapping",
    "clean_name",
    "combine_norms",
    "edit_param",
    "find_spikes",
    "full_param",
    "grad_norms",
    "layout",
    "memory",
    "merge_layouts",
    "plain_copy",
    "record_from_json",
    "record_to_json",
    "summon_stats",
]
