"""``%fsdp snapshot``, ``%fsdp journal``, ``%fsdp recover`` and ``%%fsdp --no-replay``
through a real IPython shell against a real 2-rank pool: a rank killed, the pool back to
the snapshot, the setup cells replayed and the training cell left alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from tests.pool.recovery_cells import SETUP

KILL = "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
STEP = """
x, y = synthetic_batch(step, rank)
torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
optim.step(); optim.zero_grad(); step += 1
"""
COUNTER = "from fsdp_interactive.checkpoint import StepCounter\nstep = StepCounter()\n"


def cell(shell, line, body):
    return shell.run_cell_magic("fsdp", line, body)


def weights(pool) -> dict[int, str]:
    code = "repr([p.to_local().sum().item() for p in model.parameters()])"
    results = pool.run(code, stream=False, journal=False).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


@pytest.mark.timing
def test_a_notebook_snapshots_shows_its_journal_and_recovers_after_a_death(
    pool_shell, pool, capsys, tmp_path: Path
):
    pool_shell.run_line_magic("fsdp", "restart")  # an epoch of its own: only this test's cells
    cell(pool_shell, "", SETUP + COUNTER)
    cell(pool_shell, "--no-replay", STEP * 2)
    pool_shell.run_line_magic("fsdp", "snapshot model optim --step step")
    out, _ = capsys.readouterr()
    assert "took snapshot s" in out and "of step 2" in out
    saved = weights(pool)
    cell(pool_shell, "--no-replay", STEP)  # past the snapshot

    pool_shell.run_line_magic("fsdp", "journal")
    out, _ = capsys.readouterr()
    assert "never" in out and "snapshots:" in out and "of step 2" in out

    with pytest.raises(Exception) as died:
        cell(pool_shell, "", KILL)
    rendered = "\n".join(died.value._render_traceback_())
    assert "RankDied" in rendered and "%fsdp recover" in rendered

    pool_shell.run_line_magic("fsdp", "recover --dry-run")
    out, _ = capsys.readouterr()
    assert "recover to the snapshot" in out and "replay 1 call:" in out
    pool_shell.run_line_magic("fsdp", "recover")
    out, _ = capsys.readouterr()
    assert "recovered to the snapshot" in out and "replayed 1 call:" in out
    assert weights(pool) == saved
    assert pool.run("int(step)", stream=False).results == {0: "2", 1: "2"}  # in place

    pool_shell.run_line_magic("fsdp", f"snapshot --persist {tmp_path / 'kept'}")
    out, _ = capsys.readouterr()
    assert "written to" in out and (tmp_path / "kept" / "manifest.json").exists()


def test_bad_recovery_input_names_what_to_type(pool_shell, pool):
    with pytest.raises(UsageError, match="needs the rank variables to keep"):
        pool_shell.run_line_magic("fsdp", "snapshot")
    with pytest.raises(UsageError, match="type a step number or the rank variable"):
        pool_shell.run_line_magic("fsdp", "snapshot model --step 1.5")
    with pytest.raises(UsageError, match="--keep-last 0"):
        pool_shell.run_line_magic("fsdp", "snapshot model --keep-last 0")
    with pytest.raises(UsageError, match="--world 0"):
        pool_shell.run_line_magic("fsdp", "recover --world 0")
    with pytest.raises(UsageError, match="--last 0"):
        pool_shell.run_line_magic("fsdp", "journal --last 0")
