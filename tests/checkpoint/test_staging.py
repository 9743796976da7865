"""Async staging: pinned buffers kept between saves for CUDA state, fresh pageable copies
for CPU state.

CUDA state is stood in for by :class:`tests.device_standins.OnDevice` tensors, and the
stager class by one that records its options (a pinned, non-blocking ``DefaultStager``
needs CUDA to be built). CPU saves run for real on a one-rank group.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import staging

from fsdp_interactive.checkpoint import _pipeline
from tests.device_standins import OnDevice


class RecordingStager:
    """Stands for ``DefaultStager``: keeps its options, counts ``close()`` calls."""

    def __init__(self, config):
        self.config = config
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_cuda_state_is_staged_into_pinned_buffers_kept_for_the_next_save(monkeypatch):
    monkeypatch.setattr(staging, "DefaultStager", RecordingStager)
    monkeypatch.setattr(_pipeline, "_PINNED_STAGER", None)
    on_gpu = {"model": {"w": OnDevice(torch.ones(4))}, "optim": {"state": {}}}
    first, kept = _pipeline.stager_for(on_gpu)
    again, kept_again = _pipeline.stager_for({"model": [torch.ones(1), OnDevice(torch.ones(2))]})
    assert kept and kept_again and again is first
    assert first.config.use_pinned_memory and first.config.use_non_blocking_copy
    assert not first.config.use_shared_memory and not first.config.use_async_staging


def test_cpu_state_is_staged_into_pageable_copies_made_for_each_save(monkeypatch):
    monkeypatch.setattr(staging, "DefaultStager", RecordingStager)
    monkeypatch.setattr(_pipeline, "_PINNED_STAGER", None)
    on_cpu = {"model": {"w": torch.ones(4)}, "step": 3}
    first, kept = _pipeline.stager_for(on_cpu)
    second, _ = _pipeline.stager_for(on_cpu)
    assert not kept and first is not second
    assert not first.config.use_pinned_memory and not first.config.use_non_blocking_copy
    assert _pipeline._PINNED_STAGER is None  # no pinned buffers made for CPU state


def test_holds_cuda_tensors_looks_into_nested_state():
    assert _pipeline.holds_cuda_tensors({"a": [(1, {"b": OnDevice(torch.ones(1))})]})
    assert not _pipeline.holds_cuda_tensors({"a": [(1, {"b": torch.ones(1)})], "c": "x"})


def _async_saves_of_cpu_state(root: str) -> dict:
    from torch.distributed.checkpoint.staging import DefaultStager

    from fsdp_interactive import checkpoint as ck
    from tests.checkpoint import _common as c

    made: list = []

    class Counting(DefaultStager):
        def __init__(self, config):
            super().__init__(config)
            self.options = config
            self.closed = 0
            made.append(self)

        def close(self) -> None:
            self.closed += 1
            super().close()

    real = staging.DefaultStager
    staging.DefaultStager = Counting
    try:
        model = c.build("fsdp2")
        for step in (1, 2):
            ck.async_save(f"{root}/step-{step}", model, step=step).wait()
    finally:
        staging.DefaultStager = real
    return {
        "stagers": len(made),
        "closed": [s.closed for s in made],
        "pinned": [s.options.use_pinned_memory for s in made],
        "kept": _pipeline._PINNED_STAGER is not None,
    }


def test_async_saves_of_cpu_state_free_their_staging_copies(ranks1, tmp_path):
    (result,) = ranks1.run(_async_saves_of_cpu_state, str(tmp_path))
    assert result == {"stagers": 2, "closed": [1, 1], "pinned": [False, False], "kept": False}
