"""``GradNormRecorder``: record gradient norms every step from training code (rank side)."""

from __future__ import annotations

import json
import math
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_interactive._background_groups import background_gloo_group
from fsdp_interactive.fsdp._comm_device import comm_device
from fsdp_interactive.inspect._grad_norms import (
    GradStats,
    _check_norm_type,
    combine_grad_rows,
    local_grad_row,
    module_norms,
    reduce_grad_stats,
)
from fsdp_interactive.inspect._records import GradNormRecord, record_to_json
from fsdp_interactive.wrapping import ModelParams, model_params
from fsdp_interactive.wrapping._param import world


class GradNormRecorder:
    """Records the global and per-module gradient norms of ``model`` once per step.

    Use it either as a callback, ``recorder.record()`` after ``backward()`` and before
    ``optimizer.step()``, or as a hook, ``recorder.attach(optimizer)``, which records just
    before every ``optimizer.step()``.  Each record costs one small all-gather (a few numbers
    per parameter), so every rank must record the same steps.  Gradients are only read.

    Attached, the all-gather runs in the background on a gloo group of the recorder's own
    (created once per process group, collectively, by the first ``attach``) while the step
    goes on: the gradients are read before ``step()``, as with ``record()``, but the step
    does not wait for the other ranks' numbers.  The record is complete as soon as they
    have arrived; ``history()``, ``len()``, ``flush()``, ``record()`` and ``detach()`` wait
    for it, so what they return is the same as without overlap.  ``overlap=False`` makes
    the attached recorder gather in the step, as ``record()`` does.

    ``modules_depth`` selects which module norms are kept per step (1 = top-level
    children).  ``history(since=k)`` returns the records from index ``k`` on; ``max_records``
    bounds memory (oldest dropped).  If ``log_path`` is given, rank 0 also appends one JSON
    line per step to that file so that a notebook can follow a running loop; other ranks
    never write it.

    The model may be wrapped in any way :func:`fsdp_interactive.wrapping.model_params`
    understands (the norms are then the framework's own ``clip_grad_norm_``'s, modules
    named by clean FQNs); where its parameters are is read once and again only when the
    model's parameter objects change (a new wrapping).
    """

    def __init__(
        self,
        model: nn.Module,
        norm_type: float = 2.0,
        modules_depth: int = 1,
        max_records: int = 100_000,
        log_path: str | os.PathLike[str] | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"GradNormRecorder(model): model must be an nn.Module, got {type(model).__name__}"
            )
        if modules_depth < 0:
            raise ValueError(f"modules_depth must be >= 0, got {modules_depth}")
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        self.model = model
        self.norm_type = _check_norm_type(norm_type)
        self.modules_depth = modules_depth
        self.max_records = max_records
        self.log_path = os.fspath(log_path) if log_path is not None else None
        self._records: list[GradNormRecord] = []
        self._dropped = 0
        self._step = 0
        self._handle: Any = None
        self._group: dist.ProcessGroup | None = None
        self._pending: torch.futures.Future | None = None
        self._lock = threading.Lock()
        self._params: tuple[tuple[int, ...], ModelParams] | None = None

    def record(self, step: int | None = None) -> GradNormRecord:
        """Reduce the current gradients' norms and append one record (a collective)."""
        self.flush()
        stats = reduce_grad_stats(self._model_params(), self.norm_type)
        return self._append(stats, self._next_step(step))

    def _model_params(self) -> ModelParams:
        """The model's parameters, read again only when its parameter objects changed."""
        key = tuple(id(p) for p in self.model.parameters())
        if self._params is None or self._params[0] != key:
            self._params = (key, model_params(self.model))
        return self._params[1]

    def flush(self) -> None:
        """Wait until the record of the last attached step is complete (and logged)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def attach(self, optimizer: torch.optim.Optimizer, overlap: bool = True) -> GradNormRecorder:
        """Record automatically before every ``optimizer.step()``; ``detach()`` undoes it.

        With ``overlap``, the first attach under a process group creates the recorders'
        gloo group, a collective (see the class docstring): every rank must attach.
        """
        self.detach()
        alone = world()[1] == 1
        self._group = None if alone or not overlap else background_gloo_group("grad-norms")
        self._handle = optimizer.register_step_pre_hook(self._before_step)
        return self

    def _before_step(self, *_: object) -> None:
        if self._group is None:
            self.record()
            return
        self.flush()
        step = self._next_step(None)
        names, row = local_grad_row(self._model_params(), self.norm_type)
        row = row.to(comm_device(self._group))  # the CPU: the recorders' group is gloo
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self._group))]
        work = dist.all_gather(rows, row, group=self._group, async_op=True)

        def complete(_: torch.futures.Future) -> None:
            stats = combine_grad_rows(names, torch.stack(rows).cpu(), self.norm_type)
            self._append(stats, step)

        self._pending = work.get_future().then(complete)

    def _next_step(self, step: int | None) -> int:
        value = self._step if step is None else int(step)
        self._step = value + 1
        return value

    def _append(self, stats: GradStats, step: int) -> GradNormRecord:
        names, norms, nans, infs, has_grad = stats
        kept = [i for i in range(len(names)) if bool(has_grad[i])]
        per_module = module_norms(
            [names[i] for i in kept], [float(norms[i]) for i in kept], self.norm_type
        )
        total = per_module.get("", 0.0)
        nan_count = int(sum(int(nans[i]) for i in kept))
        inf_count = int(sum(int(infs[i]) for i in kept))
        if nan_count:
            total = math.nan
        elif inf_count:
            total = math.inf
        shown = {
            name: value
            for name, value in per_module.items()
            if name and name.count(".") < self.modules_depth
        }
        record = GradNormRecord(
            step=step, total=total, modules=shown, nan_count=nan_count, inf_count=inf_count
        )
        with self._lock:
            self._records.append(record)
            if len(self._records) > self.max_records:
                overflow = len(self._records) - self.max_records
                del self._records[:overflow]
                self._dropped += overflow
        if self.log_path is not None and world()[0] == 0:
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(json.dumps(record_to_json(record)) + "\n")
        return record

    def detach(self) -> None:
        """Stop recording (after completing the last attached step's record)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.flush()

    def history(self, since: int = 0) -> list[GradNormRecord]:
        """Records with index >= ``since`` (indices count every record ever made)."""
        self.flush()
        with self._lock:
            start = max(0, since - self._dropped)
            return list(self._records[start:])

    def __len__(self) -> int:
        self.flush()
        return self._dropped + len(self._records)

    def clear(self) -> None:
        """Forget every recorded step (what is still being gathered is awaited first) and count
        steps from 0 again."""
        self.flush()
        with self._lock:
            self._records.clear()
            self._dropped = 0
            self._step = 0
