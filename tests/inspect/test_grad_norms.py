"""grad_norms() and GradNormRecorder against clip_grad_norm_ on an unsharded reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from fsdp_interactive.inspect import GradNormRecorder, grad_norms, record_from_json
from tests.models import backward, sharded_and_reference

RTOL = 1e-5


def _norms_vs_reference(norm_type, mesh_shape=None):
    model, reference = sharded_and_reference(mesh_shape)
    backward(model)
    backward(reference)
    probe = grad_norms(model, norm_type)
    ref_params = {
        n: float(torch.linalg.vector_norm(p.grad, norm_type))
        for n, p in reference.named_parameters()
    }
    ref_block = float(
        torch.nn.utils.get_total_norm([p.grad for p in reference.block.parameters()], norm_type)
    )
    ref_total = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9, norm_type))
    return probe, ref_params, ref_block, ref_total


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_global_norm_equals_clip_grad_norm_on_unsharded_reference(ranks2, norm_type):
    results = ranks2.run(_norms_vs_reference, norm_type)
    for probe, ref_params, ref_block, ref_total in results:
        assert probe.total == pytest.approx(ref_total, rel=RTOL)
        assert probe.params == pytest.approx(ref_params, rel=RTOL)
        assert probe.modules["block"] == pytest.approx(ref_block, rel=RTOL)
        assert probe.modules[""] == pytest.approx(ref_total, rel=RTOL)
        assert not probe.has_nonfinite


def test_hybrid_mesh_counts_replicas_once(ranks2):
    # a (replicate=2, shard=1) mesh: both ranks hold every gradient in full
    results = ranks2.run(_norms_vs_reference, 2.0, (2, 1))
    for probe, ref_params, _, ref_total in results:
        assert probe.total == pytest.approx(ref_total, rel=RTOL)
        assert probe.params == pytest.approx(ref_params, rel=RTOL)


def _nan_on_rank_one():
    model, _ = sharded_and_reference()
    backward(model)
    if dist.get_rank() == 1:
        model.block[0].weight.grad.to_local()[0, 0] = float("nan")
        model.embed.bias.grad.to_local()[0] = float("inf")
    return grad_norms(model)


def test_nan_and_inf_are_flagged_on_every_rank(ranks2):
    for probe in ranks2.run(_nan_on_rank_one):
        assert probe.nan_counts == {"block.0.weight": 1}
        assert probe.inf_counts == {"embed.bias": 1}
        assert math.isnan(probe.total)
        assert probe.nonfinite == ["block.0.weight", "embed.bias"]


def test_bad_norm_type_is_rejected():
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        grad_norms(torch.nn.Linear(2, 2), norm_type=-1)


def _record_three_steps(log_path):
    model, reference = sharded_and_reference()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    recorder = GradNormRecorder(model, log_path=log_path).attach(optim)
    expected = []
    for step in range(3):
        for m, o in ((model, optim), (reference, ref_optim)):
            o.zero_grad()
            backward(m, seed=10 + step)
        expected.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)))
        optim.step()
        ref_optim.step()
    recorder.detach()
    optim.zero_grad()
    backward(model)
    optim.step()  # detached: not recorded
    return recorder.history(), recorder.history(since=2), expected


def test_recorder_records_every_step_like_clip_grad_norm(ranks2, tmp_path):
    log_path = str(tmp_path / "norms.jsonl")
    results = ranks2.run(_record_three_steps, log_path)
    for history, tail, expected in results:
        assert [r.step for r in history] == [0, 1, 2]
        assert [r.total for r in history] == pytest.approx(expected, rel=RTOL)
        assert set(history[0].modules) == {"embed", "block"}
        assert tail == history[2:]
    with open(log_path, encoding="utf-8") as log:
        lines = log.read().splitlines()
    assert len(lines) == 3  # rank 0 alone writes the log
    assert [record_from_json(line) for line in lines] == results[0][0]


def test_recorder_validates_arguments():
    with pytest.raises(TypeError, match=r"must be an nn\.Module"):
        GradNormRecorder(object())
    with pytest.raises(ValueError, match="modules_depth"):
        GradNormRecorder(torch.nn.Linear(2, 2), modules_depth=-1)


def _huge_but_finite_gradient():
    model, reference = sharded_and_reference()
    backward(model)
    backward(reference)
    for m in (model, reference):
        grad = m.block[0].weight.grad
        (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(1e30)
    expected = float(
        torch.linalg.vector_norm(reference.block[0].weight.grad.double(), dtype=torch.float64)
    )
    return grad_norms(model), expected


def test_a_norm_that_overflows_float32_is_measured_in_float64(ranks2):
    # 1e30 squared overflows float32: a float32-only probe would report inf
    for probe, expected in ranks2.run(_huge_but_finite_gradient):
        assert probe.params["block.0.weight"] == pytest.approx(expected, rel=RTOL)
        assert math.isfinite(probe.total) and not probe.has_nonfinite


def _overlapped_and_in_step_recorders(steps):
    model, _ = sharded_and_reference()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    background = GradNormRecorder(model).attach(optim)  # overlap=True, the default
    in_step = GradNormRecorder(model).attach(optim, overlap=False)
    for step in range(steps):
        optim.zero_grad()
        backward(model, seed=20 + step)
        if step == 2 and dist.get_rank() == 1:
            model.block[0].weight.grad.to_local()[0, 0] = float("nan")
        optim.step()
    return background.history(), in_step.history(), len(background)


def test_an_overlapped_recorder_records_exactly_what_an_in_step_one_does(ranks2):
    for background, in_step, count in ranks2.run(_overlapped_and_in_step_recorders, 4):
        assert count == 4
        assert [r.step for r in background] == [0, 1, 2, 3]
        assert [r.modules for r in background[:2]] == [r.modules for r in in_step[:2]]
        assert [r.total for r in background[:2]] == [r.total for r in in_step[:2]]
        assert background[2].nan_count == in_step[2].nan_count == 1
        assert math.isnan(background[2].total)


def test_norm_per_fsdp_unit_combines_the_units_parameters(ranks2):
    from fsdp_interactive.inspect import combine_norms

    results = ranks2.run(_norms_vs_reference, 2.0)
    for probe, ref_params, ref_block, _ in results:
        assert probe.unit_of["block.0.weight"] == "block" and probe.unit_of["embed.bias"] == ""
        assert probe.units["block"] == pytest.approx(ref_block, rel=RTOL)
        root = [ref_params["embed.weight"], ref_params["embed.bias"]]
        assert probe.units[""] == pytest.approx(combine_norms(root, 2.0), rel=RTOL)
        assert combine_norms([3.0, 4.0], 2.0) == 5.0 and combine_norms([], 2.0) == 0.0
        assert combine_norms([3.0, 4.0], math.inf) == 4.0
