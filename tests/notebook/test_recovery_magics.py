"""``%fsdp snapshot``, ``%fsdp journal``, ``%fsdp recover`` and ``%%fsdp --no-replay``
through a real IPython shell against a real 2-rank pool: a rank killed, during a cell or
between cells, the pool back to the snapshot (by hand or by itself), the setup cells
replayed and the training cell left alone; and what the magics say, in their own words."""

from __future__ import annotations

import ast
import os
import signal
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from fsdp_interactive.pool.processes._pids import start_time
from tests.pool.conftest import wait_gone
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
    assert "took snapshot s" in out and "of step 2 of model, optim" in out
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


def rendered(error: BaseException) -> str:
    """What the notebook shows for an error a magic raised."""
    render = getattr(error, "_render_traceback_", None)
    return "\n".join(render()) if render is not None else f"{type(error).__name__}: {error}"


def kill_between_cells(pool, rank: int) -> None:
    """SIGKILL ``rank`` while no cell runs, and wait until its process is gone."""
    pid = pool.topology[rank].pid
    created = start_time(pid)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone({pid: created}, timeout=30) == []


@pytest.mark.timing
def test_a_death_between_cells_the_journal_and_snapshot_errors_in_magic_words(
    pool_shell, pool, capsys
):
    """Status shows a rank that died between cells without raising; the next cell raises
    RankDied (not an ipyparallel error) advising a recovery, which a snapshot allows; the
    journal shows each snapshot in the row of the call that took it, at once, and never
    the code the magics made, nor does an error of %fsdp snapshot."""
    shell = pool_shell
    shell.run_line_magic("fsdp", "restart")
    cell(shell, "", SETUP + COUNTER)
    taking = "import fsdp_interactive\nfsdp_interactive.snapshot(model=model, step=step)"
    cell(shell, "--no-replay", STEP + taking)
    first = pool.journal.entries[-1].snapshots  # read as the cell ended
    shell.run_line_magic("fsdp", "snapshot model optim --step step")
    second = pool.journal.entries[-1].snapshots
    assert len(first) == len(second) == 1 and first != second
    with pytest.raises(UsageError) as misnamed:
        shell.run_line_magic("fsdp", "snapshot modle optim")
    assert "NameError" in str(misnamed.value) and "_fsdp" not in str(misnamed.value)
    capsys.readouterr()
    shell.run_line_magic("fsdp", "journal")
    out, _ = capsys.readouterr()
    epoch = str(pool.journal.epoch.number)  # this test's rows (the shared pool has more)
    rows = [line for line in out.splitlines() if line[:1].isdigit() and line.split()[1] == epoch]
    [taken_in_cell] = [row for row in rows if "x, y = synthetic_batch" in row]
    [taken_by_magic] = [row for row in rows if "%fsdp snapshot model optim" in row]
    assert first[0] in taken_in_cell and second[0] in taken_by_magic
    assert not [row for row in rows if "_fsdpi" in row or "_fsdp_interactive" in row], rows

    kill_between_cells(pool, 1)
    shell.run_line_magic("fsdp", "status")  # does not raise
    out, _ = capsys.readouterr()
    assert "pool broken: rank 1 (pid" in out and "killed by signal SIGKILL" in out
    assert "%fsdp recover" in out and "%fsdp restart" in out
    with pytest.raises(Exception) as died:
        cell(shell, "", "print('never runs')")
    text = rendered(died.value)
    assert text.startswith("RankDied: rank 1 (pid") and "This call did not run." in text
    assert "Go back to the last snapshot with %fsdp recover" in text
    assert "IndexError" not in text and "never runs" not in capsys.readouterr().out
    shell.run_line_magic("fsdp", "status")  # about the death, not about the call above
    out, _ = capsys.readouterr()
    assert "pool broken: rank 1 (pid" in out and "This call did not run." not in out
    with pytest.raises(UsageError, match=r"no running pool \(a rank died: rank 1"):
        shell.run_line_magic("fsdp", "push SETUP")
    with pytest.raises(Exception) as gone:
        cell(shell, "", "print('never runs')")
    assert "PoolNotRunning: rank 1 (pid" in rendered(gone.value)
    shell.run_line_magic("fsdp", "recover")
    assert pool.run("int(step)", stream=False).results == {0: "1", 1: "1"}


def test_recover_errors_and_usage_name_the_magics_options(pool_shell, pool, tmp_path):
    with pytest.raises(UsageError) as bad:
        pool_shell.run_line_magic("fsdp", "recover --bogus")
    assert str(bad.value).endswith("usage: %fsdp recover [--from ID|DIR] [--world N] [--dry-run]")
    pids = [r.pid for r in pool.topology]
    for line in (f"recover --from {tmp_path}", f"recover --dry-run --from {tmp_path}"):
        with pytest.raises(Exception) as refused:
            pool_shell.run_line_magic("fsdp", line)
        text = rendered(refused.value)
        assert "is not a checkpoint folder" in text and "nothing was changed" in text
        assert "%fsdp snapshot --persist DIR" in text and "persist_snapshot(" not in text
    assert pool.running and [r.pid for r in pool.topology] == pids
