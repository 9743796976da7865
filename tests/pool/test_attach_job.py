"""Attaching to a running torchrun job: status, stacks, a held rank diagnosed, a pause at
step 5 with true views, a snapshot and a checkpoint a pool loads, resume, detach, and the
job ending bit for bit as the same job never attached.

One attachable job (2 ranks) runs beside the same job started without the module; the
tests below follow it in order (each test a stage of one attach session).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fsdp_interactive
from fsdp_interactive.notebook._snapshot_taking import persist_snapshot, take_snapshot
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.pool import AttachedJob, JobNotPaused, Pool, RankError
from tests.inspect._full_stats import assert_equal_stats, full_tensor_stats
from tests.pool.attach_jobs import TorchrunJob, same_bits

HOLD_AT = 3
STEPS = ["--steps", "9"]


def _hold(release: Path) -> list[str]:
    return ["--hold-at", str(HOLD_AT), "--hold-rank", "1", "--release", str(release)]


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, unattached_run: Path
) -> Iterator[SimpleNamespace]:
    folder = tmp_path_factory.mktemp("attach-job")
    os.chmod(folder, 0o700)
    release = folder / "release"
    job = TorchrunJob(folder, 2, *STEPS, *_hold(release), "--out", str(folder / "attached.pt"))
    with job:
        records = job.wait_attachable()
        attached = fsdp_interactive.attach(job.job_folder, hang_after=0.5)
        try:
            yield SimpleNamespace(
                job=job,
                plain=unattached_run,
                attached=attached,
                records=records,
                folder=folder,
                release=release,
            )
        finally:
            release.touch()
            attached.detach()


def test_attach_shows_every_rank_and_its_stack_without_pausing(runs):
    job: AttachedJob = runs.attached
    assert job.state == "attached" and job.world_size == 2
    # attached as soon as the ranks wrote their records (before their group formed);
    # looked at once both are held before step 3 (rank 0 in the loss's all_reduce)
    status = _wait(lambda: _held(job.status()))
    assert sorted(status.states) == [0, 1] and not status.gone
    for record in runs.records:
        state = status.states[record.rank]
        assert (state.pid, state.host, state.step) == (record.pid, record.host, HOLD_AT - 1)
    assert [(r.pid, r.backend) for r in job.topology] == [(r.pid, "gloo") for r in runs.records]
    stacks, where = job.stacks()
    assert sorted(stacks) == sorted(where) == [0, 1]
    for rank in (0, 1):
        assert 'attach_train.py", line' in stacks[rank], stacks[rank]
        assert "fsdp_interactive/attachable.py" not in stacks[rank]  # the entry is machinery


def _held(status):
    states = status.states
    held = len(states) == 2 and all(s.step == HOLD_AT - 1 for s in states.values())
    return status if held and states[0].collective is not None else None


def test_cells_need_a_pause(runs):
    with pytest.raises(JobNotPaused, match=r"Pause it at a step boundary first with job.pause\(\)"):
        runs.attached.run("1")


def _wait(condition, timeout: float = 120.0, every: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {condition}")


def test_a_rank_held_before_a_collective_is_named_by_trace_and_the_hang_report(runs):
    job: AttachedJob = runs.attached
    report = _wait(lambda: job.hang_report(after=0.5))
    text = str(report)
    assert "rank 0 has waited" in text and "all_reduce" in text, text
    assert any(
        line.startswith("rank 1 is at step 2, outside training: in main (attach_train.py:")
        for line in report.lines
    ), report.lines
    trace = job.trace()
    finding = next(f for f in trace.findings if "never issued" in f)
    assert finding.startswith("rank 0 waits in all_reduce #"), finding
    assert "rank 1 never issued #" in finding and "now in main (attach_train.py:" in finding, (
        finding
    )
    status = job.status()
    assert status.hang and status.states[0].collective.startswith("all_reduce #")
    assert "hang:" in "\n".join(status.lines(notebook=True)) and "%fsdp trace" in "\n".join(
        status.lines(notebook=True)
    )
    # armed while held, so that the next stage finds the job paused at step 5 whatever its speed
    assert job.pause(at_step=5, wait=False) == 5
    assert {s.pause_target for s in job.status().states.values()} == {5}
    runs.release.touch()


def test_pause_at_step_5_then_views_tell_the_truth(runs):
    job: AttachedJob = runs.attached
    assert job.pause(at_step=5, timeout=120) == 5
    status = job.status()
    assert {s.step for s in status.states.values()} == {5}
    assert {s.phase for s in status.states.values()} == {"paused"}
    assert all(
        "attach_train.py" in s.where and "optimizer.step()" in s.where
        for s in status.states.values()
    )

    # cells run in the training thread and see the paused frame's locals
    result = job.run(
        "print(step, rank := dist.get_rank())\nlen(list(model.parameters()))", stream=False
    )
    assert result.stdout == {0: "4 0\n", 1: "4 1\n"} and result.results == {0: "4", 1: "4"}
    with pytest.raises(RankError, match="ZeroDivisionError"):
        job.run("1 / 0", stream=False)

    views = RankModel(job, "model", "optimizer")
    norms = views.grad_norms()
    job.run(
        "import torch\n_total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)\n"
        "_total = float(_total.full_tensor() if hasattr(_total, 'full_tensor') else _total)",
        stream=False,
    )
    assert norms.total == pytest.approx(job.pull("_total")[0], rel=1e-6)

    layout = views.layout()
    job.run(
        "_shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}",
        stream=False,
    )
    shapes = job.pull("_shapes")
    for param in layout.params:
        assert param.placements == ("Shard(dim=0)",) or "Shard" in param.placements[0], param
        for piece in param.slices:
            assert piece.local_shape == shapes[piece.rank][param.fqn], (param.fqn, piece)

    memory = views.memory()
    assert [(m.rank, m.pid, m.device) for m in memory] == [
        (r.rank, r.pid, "cpu") for r in runs.records
    ]

    stats = views.summon("0.weight")
    job.run("_full = model[0].weight.full_tensor()", stream=False)
    full = job.pull("_full")[0]
    assert_equal_stats(
        stats, full_tensor_stats([full], len(stats.hist_counts)), float(full.detach().abs().max())
    )


def test_a_snapshot_and_a_checkpoint_of_the_paused_job_load_in_the_kits_pool(runs, pool: Pool):
    job: AttachedJob = runs.attached
    snapshot_dir, checkpoint_dir = runs.folder / "snapshot", runs.folder / "checkpoint"
    taken = take_snapshot(job, "model", "optimizer")
    persist_snapshot(job, taken if isinstance(taken, str) else taken.id, str(snapshot_dir))
    job.run(
        "import fsdp_interactive.checkpoint as _ck\n"
        f"_ck.save({str(checkpoint_dir)!r}, model, optimizer)\n"
        "_state = {n: p.full_tensor() for n, p in model.named_parameters()}",
        stream=False,
    )
    expected = job.pull("_state")[0]
    pool.run(
        "from torch.distributed.fsdp import fully_shard\n"
        "import fsdp_interactive.checkpoint as ck\n"
        "def fresh():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))\n"
        "    for layer in (m[0], m[2]):\n"
        "        fully_shard(layer)\n"
        "    fully_shard(m)\n"
        "    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)\n"
        "loaded = {}\n"
        f"for key, path in (('snapshot', {str(snapshot_dir)!r}), ('checkpoint', {str(checkpoint_dir)!r})):\n"
        "    m, o = fresh()\n"
        "    ck.load(path, m, o)\n"
        "    loaded[key] = ({n: p.full_tensor() for n, p in m.named_parameters()}, len(o.state))\n",
        stream=False,
    )
    try:
        loaded = pool.pull("loaded")[0]
    finally:
        pool.run("del loaded, fresh", stream=False)
    for key in ("snapshot", "checkpoint"):
        params, optimizer_states = loaded[key]
        assert params.keys() == expected.keys()
        assert all(torch.equal(params[n], expected[n]) for n in params), key
        assert optimizer_states == len(expected), key


def test_resume_then_detach_leave_the_job_computing_what_it_would_have(runs):
    job: AttachedJob = runs.attached
    job.resume()
    assert job.state == "attached"

    def went_on() -> bool:  # past step 5, or already ended (the ranks said they exit)
        status = job.status()
        return all(s.step > 5 for s in status.states.values()) and bool(
            status.states or status.gone
        )

    _wait(went_on)
    job.detach()
    assert job.state == "detached"
    assert runs.job.wait() == 0, runs.job.output()
    assert same_bits(runs.plain, runs.folder / "attached.pt")
    assert not runs.job.job_folder.exists()  # the ranks removed their records as they ended


@pytest.mark.world4
def test_four_ranks_attach_with_status_and_stacks_and_pause_together(tmp_path):
    os.chmod(tmp_path, 0o700)
    stop = tmp_path / "stop"
    with TorchrunJob(tmp_path, 4, "--stop-file", str(stop), "--step-sleep", "0.05") as running:
        records = running.wait_attachable()
        job = fsdp_interactive.attach(running.job_folder)
        try:
            status = job.status()
            assert sorted(status.states) == [0, 1, 2, 3]
            assert [status.states[r.rank].pid for r in records] == [r.pid for r in records]
            stacks, where = job.stacks()
            assert sorted(stacks) == sorted(where) == [0, 1, 2, 3]
            step = job.pause(timeout=120)
            assert {s.step for s in job.status().states.values()} == {step}
            assert job.run("dist.get_world_size(), step", stream=False).results == {
                r: f"(4, {step - 1})" for r in range(4)
            }
        finally:
            job.detach()
            stop.touch()
        assert running.wait() == 0, running.output()
