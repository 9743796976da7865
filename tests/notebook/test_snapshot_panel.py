"""SnapshotPanel against a real 2-rank pool, through its buttons and its calls: Snapshot now
lists the snapshot with its step and age, Plan recovery shows the plan, and Recover brings
a killed rank's pool back to the snapshot with the recovery's report in the panel."""

from __future__ import annotations

import pytest

from fsdp_interactive.notebook import RankModel, SnapshotPanel
from fsdp_interactive.pool import RankDied
from tests.pool.recovery_cells import SETUP

KILL_RANK_1 = "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"


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


def test_snapshot_now_plan_and_recover_after_a_death(fresh_pool):
    pool = fresh_pool
    pool.run(SETUP, cell=1, stream=False)
    panel = SnapshotPanel(RankModel(pool, "model", "optim"))
    widget = panel.widget
    assert panel._recover_button.disabled and "(none yet)" in panel.text()
    panel._step.value = 7
    panel._snapshot_button.click()
    assert panel.error is None, panel.status
    [info] = panel.snapshots
    assert info.step == 7 and "took snapshot" in panel.status
    row = panel.text().splitlines()[-2]
    assert info.id in row and " 7 " in row and " s" in row
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


def test_bad_arguments_are_refused(pool):
    with pytest.raises(TypeError, match="source must be a RankModel"):
        SnapshotPanel(pool)
    with pytest.raises(ValueError, match="keep_last must be a number of snapshots >= 1"):
        SnapshotPanel(RankModel(pool), keep_last=0)
