"""Checkpoints of state held on CUDA (skipped where no CUDA device is present).

Runs in the test process without a process group (a single-process save): async staging
from CUDA goes through pinned buffers that the next save reuses, and the checkpoint holds
the values of save time.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.cuda


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _tensors(value)]
    if isinstance(obj, list | tuple):
        return [t for value in obj for t in _tensors(value)]
    return []


def _model(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optim: torch.optim.Optimizer, device: torch.device) -> None:
    model(torch.randn(8, 256, device=device)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def save_twice_and_reload(root, device: torch.device, staged: list) -> dict:
    """Two async saves of a model on ``device`` with a step between; the second reloaded
    into a fresh model. ``staged`` collects what the stager handed to the writer."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from fsdp_interactive import checkpoint as ck

    real_stage = DefaultStager.stage

    def stage(self, state_dict, **kwargs):
        result = real_stage(self, state_dict, **kwargs)
        staged.append(result)
        return result

    model, optim = _model(device)
    _step(model, optim, device)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DefaultStager, "stage", stage)
        ck.async_save(root / "a", model, optim, step=1).wait()
        _step(model, optim, device)
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        ck.async_save(root / "b", model, optim, step=2).wait()
        _step(model, optim, device)  # after the save: must not reach the checkpoint
    fresh, fresh_optim = _model(device)
    ck.load(root / "b", fresh, fresh_optim)
    return {k: torch.equal(v.detach().cpu(), expected[k]) for k, v in fresh.state_dict().items()}


def test_async_saves_from_cuda_stage_into_pinned_buffers_reused_by_the_next(tmp_path):
    from fsdp_interactive.checkpoint import _pipeline

    staged: list = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_pipeline, "_PINNED_STAGER", None)
        loaded = save_twice_and_reload(tmp_path, torch.device("cuda"), staged)
        assert _pipeline._PINNED_STAGER is not None
    assert loaded and all(loaded.values()), loaded
    first, second = (_tensors(s) for s in staged)
    big = [t for t in first + second if t.numel() * t.element_size() >= 1024]
    assert big and all(t.device.type == "cpu" and t.is_pinned() for t in big)
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in second]  # reused
