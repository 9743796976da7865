"""SnapshotPanel against a real 2-rank pool, through its buttons and its calls: Snapshot now
lists the snapshot with its step (the training's, without one typed), age and cell, Plan
recovery shows the plan, and Recover, busy while it runs, brings a killed rank's pool back
to the snapshot with the recovery's report in the panel; the dashboard shows a rank that
died between cells."""

from __future__ import annotations

import os
import signal

import pytest

from fsdp_interactive.notebook import RankModel, SnapshotPanel
from fsdp_interactive.pool import RankDied
from fsdp_interactive.pool.processes._pids import start_time
from tests.pool.conftest import wait_gone
from tests.pool.recovery_cells import SETUP

KILL_RANK_1 = "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
COUNTER = "import fsdp_interactive\nfrom fsdp_interactive.checkpoint import StepCounter\nstep = StepCounter()\n"
STEP = """
x, y = synthetic_batch(0, rank)
torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
"""


def weights(pool) -> dict[int, str]:
    code = "repr([p.to_local().sum().item() for p in model.parameters()])"
    return pool.run(code, stream=False, journal=False).results


@pytest.fixture()
def fresh_pool(pool_shell):
    """The session's pool stopped and started again: the snapshots earlier tests left in
    host memory are freed by the stop, and the journal starts empty."""
    from fsdp_interactive.notebook.magics import current_pool

    current_pool().stop()
    pool_shell.run_line_magic("fsdp", "restart")
    pool = current_pool()
    assert pool.running and pool.snapshots() == []
    return pool


@pytest.fixture()
def restarted_pool(pool_shell):
    """The session's pool on a fresh group (an epoch of its own); the snapshots earlier
    tests left stay in host memory."""
    from fsdp_interactive.notebook.magics import current_pool

    pool_shell.run_line_magic("fsdp", "restart")
    return current_pool()


def test_snapshot_now_plan_and_recover_after_a_death(fresh_pool):
    pool = fresh_pool
    pool.run(SETUP, cell=1, stream=False)
    panel = SnapshotPanel(RankModel(pool, "model", "optim"))
    widget = panel.widget
    assert panel._recover_button.disabled and "(none yet)" in panel.text()
    panel._step.value = "7"
    panel._snapshot_button.click()
    assert panel.error is None, panel.status
    [info] = panel.snapshots
    assert info.step == 7 and "took snapshot" in panel.status
    row = panel.text().splitlines()[-2]
    assert info.id in row and " 7 " in row and " s" in row and "after In[1]" in row
    assert not panel._recover_button.disabled and info.id in panel._table.value
    saved = weights(pool)
    pool.run(
        "optim.param_groups[0]['lr'] = 0.5\nwith torch.no_grad():\n"
        "    next(model.parameters()).add_(1.0)",
        stream=False,
    )

    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, stream=False)
    panel._plan_button.click()
    assert "recover to the snapshot" in panel.status and not pool.running
    panel._recover_button.click()
    assert panel.error is None, panel.status
    assert panel.status.startswith("recovered to the snapshot") and "of step 7" in panel.status
    assert "replayed 1 call: In[1]" in panel._report.value
    assert weights(pool) == saved
    assert widget is panel.widget


def test_snapshot_now_records_the_training_step_and_recover_shows_it_is_busy(restarted_pool):
    """Empty step field: the step counter's value (10, not 0), kept so a recovery restores
    it; snapshots are named by the cells they were taken in or after; while Recover runs
    the buttons are disabled and the last status and plan are gone; a plan whose snapshot
    was rotated away is dropped."""
    pool = restarted_pool
    pool.run(SETUP + COUNTER, cell=3, stream=False)
    pool.run("step += 10", cell=4, stream=False, replay=False)
    panel = SnapshotPanel(RankModel(pool, "model", "optim"))
    panel.widget  # noqa: B018 - the buttons exist
    assert panel.step_counter() == "step"
    panel._snapshot_button.click()
    assert panel.error is None, panel.status
    # keep_last counts snapshots of the same objects: an earlier test's of model and optim
    # alone may still be held.
    [info] = [s for s in panel.snapshots if s.names["stateful"]]
    assert info.step == 10 and info.names["stateful"] == {"step": "step"}
    assert f"took snapshot {info.id} of step 10 of model, optim, step" in panel.status
    assert "after In[4]" in panel.text() and "call " not in panel.text()

    pool.run("fsdp_interactive.snapshot(model=model, optimizer=optim, step=step)", cell=5)
    panel.refresh()
    # keep_last=1: the panel's was rotated away
    [info] = [s for s in panel.snapshots if s.names["stateful"]]
    assert "In[5]" in panel.text() and "after" not in panel.text().splitlines()[-1]
    panel._plan_button.click()
    assert panel.report is not None and info.id in str(panel.report)

    seen = []
    progress = panel._progress

    def watched(line: str) -> None:
        progress(line)
        buttons = [panel._snapshot_button, panel._plan_button, panel._recover_button]
        seen.append(
            (
                line,
                panel.busy and all(b.disabled for b in buttons),
                panel._report.value,
                panel._status.value,
            )
        )

    panel._progress = watched
    pool.run("step += 5", cell=6, stream=False, replay=False)
    panel._recover_button.click()
    assert panel.error is None, panel.status
    assert [line for line, *_ in seen][:4] == [
        "recovering",
        "recovery: ending the old group ...",
        "recovery: starting a fresh group of 2 ranks ...",
        next(line for line, *_ in seen if line.startswith("recovery: a fresh group of 2 ")),
    ]
    assert all(busy and report == "" for _, busy, report, _ in seen)
    assert all("took" not in status and "recover to" not in status for *_, status in seen)
    assert not panel._recover_button.disabled and "recovered to the snapshot" in panel.status
    assert pool.run("int(step)", stream=False).results == {0: "10", 1: "10"}  # in place

    panel._plan_button.click()
    assert info.id in str(panel.report)
    pool.run("fsdp_interactive.snapshot(model=model, optimizer=optim, step=step)", cell=7)
    panel.refresh()
    assert panel.report is None and panel._report.value == ""


@pytest.mark.timing
def test_the_dashboard_shows_a_rank_that_died_between_cells(restarted_pool):
    from fsdp_interactive.notebook import Dashboard

    pool = restarted_pool
    pool.run(SETUP + STEP, cell=1, stream=False)
    dashboard = Dashboard(RankModel(pool, "model", "optim"))
    dashboard.widget  # noqa: B018 - drawn, as in a notebook
    assert "pool running, 2 ranks" in dashboard.text()
    pid = pool.topology[1].pid
    created = start_time(pid)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone({pid: created}, timeout=30) == []
    dashboard.refresh()  # finds it, without raising
    text = dashboard.text()
    assert f"pool broken: rank 1 (pid {pid} on" in text and "killed by signal SIGKILL" in text
    assert "%fsdp restart" in text and "pool broken" in dashboard._ranks.value
    with pytest.raises(RankDied, match="This call did not run"):
        pool.run("1", stream=False)


def test_bad_arguments_are_refused(pool):
    with pytest.raises(TypeError, match="source must be a RankModel"):
        SnapshotPanel(pool)
    with pytest.raises(ValueError, match="keep_last must be a number of snapshots >= 1"):
        SnapshotPanel(RankModel(pool), keep_last=0)
