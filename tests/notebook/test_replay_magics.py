"""``%%fsdp --replay`` / ``--no-replay`` and what ``%fsdp journal`` and ``%fsdp recover
--dry-run`` say about each cell's part in a recovery, through a real IPython shell against a
real 2-rank pool."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from tests.pool.recovery_cells import SETUP

TRAIN = """
x, y = synthetic_batch(0, rank)
torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
optim.step(); optim.zero_grad()
"""


def cell(shell, line, body):
    return shell.run_cell_magic("fsdp", line, body)


def test_journal_and_dry_run_say_each_cells_part_and_why(pool_shell, pool, capsys):
    pool_shell.run_line_magic("fsdp", "restart")
    cell(pool_shell, "", SETUP)
    setup = pool.journal.entries[-1].label
    cell(pool_shell, "", TRAIN)
    train = pool.journal.entries[-1].label
    cell(pool_shell, "--replay", "marker = []")
    forced = pool.journal.entries[-1]
    cell(pool_shell, "--no-replay", "hook = model.register_forward_hook(lambda *args: None)")
    kept_out = pool.journal.entries[-1]
    assert (forced.replay, kept_out.replay, pool.journal.entries[-3].replay) == (True, False, None)
    pool_shell.run_line_magic("fsdp", "snapshot model optim")
    capsys.readouterr()

    pool_shell.run_line_magic("fsdp", "journal")
    out = capsys.readouterr().out
    assert "always" in out and "never" in out and "auto" in out
    assert "what %fsdp recover would do now:" in out
    assert f"  {setup} defines model, optim" in out
    assert f"  {train} skipped: uses model, optim, whose state the snapshot holds" in out
    assert f"  {forced.label} forced by %%fsdp --replay" in out
    assert f"  {kept_out.label} skipped: marked %%fsdp --no-replay" in out

    pool_shell.run_line_magic("fsdp", "recover --dry-run")
    dry = capsys.readouterr().out
    assert f"replay 2 calls: {setup}, {forced.label}" in dry
    assert f"  {train} skipped: uses model, optim" in dry


def test_replay_and_no_replay_together_are_refused(pool_shell, pool):
    before = len(pool.journal.entries)
    with pytest.raises(UsageError, match="either --replay or --no-replay"):
        cell(pool_shell, "--replay --no-replay", "x = 1")
    assert len(pool.journal.entries) == before
