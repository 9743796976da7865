"""``GradNormRecorder``: record gradient norms every step from training code (rank side)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from torch import nn

from fsdp_interactive.inspect._dtensor import world
from fsdp_interactive.inspect._grad_norms import _check_norm_type, module_norms, reduce_grad_stats
from fsdp_interactive.inspect._records import GradNormRecord, record_to_json


class GradNormRecorder:
    """Records the global and per-module gradient norms of ``model`` once per step.

    Use it either as a callback, ``recorder.record()`` after ``backward()`` and before
    ``optimizer.step()``, or as a hook, ``recorder.attach(optimizer)``, which records just
    before every ``optimizer.step()``.  Each record costs one small all-reduce over the
    default group (a few numbers per parameter; two all-reduces for ``norm_type=inf``), so
    every rank must record the same steps.  Gradients are only read.

    ``modules_depth`` selects which module norms are kept per step (1 = top-level
    children).  ``history(since=k)`` returns the records from index ``k`` on; ``max_records``
    bounds memory (oldest dropped).  If ``log_path`` is given, rank 0 also appends one JSON
    line per step to that file so that a notebook can follow a running loop; other ranks
    never write it.
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

    def record(self, step: int | None = None) -> GradNormRecord:
        """Reduce the current gradients' norms and append one record (a collective)."""
        names, norms, nans, infs, has_grad = reduce_grad_stats(self.model, self.norm_type)
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
            step=self._step if step is None else int(step),
            total=total,
            modules=shown,
            nan_count=nan_count,
            inf_count=inf_count,
        )
        self._step = record.step + 1
        self._records.append(record)
        if len(self._records) > self.max_records:
            overflow = len(self._records) - self.max_records
            del self._records[:overflow]
            self._dropped += overflow
        if self.log_path is not None and world()[0] == 0:
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(json.dumps(record_to_json(record)) + "\n")
        return record

    def attach(self, optimizer: torch.optim.Optimizer) -> GradNormRecorder:
        """Record automatically before every ``optimizer.step()``; ``detach()`` undoes it."""
        self.detach()
        self._handle = optimizer.register_step_pre_hook(self._before_step)
        return self

    def _before_step(self, *_: object) -> None:
        self.record()

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def history(self, since: int = 0) -> list[GradNormRecord]:
        """Records with index >= ``since`` (indices count every record ever made)."""
        start = max(0, since - self._dropped)
        return list(self._records[start:])

    def __len__(self) -> int:
        return self._dropped + len(self._records)

    def clear(self) -> None:
        self._records.clear()
        self._dropped = 0
        self._step = 0
