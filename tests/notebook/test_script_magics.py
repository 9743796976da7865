"""``%fsdp run`` and ``%fsdp continue`` through a real IPython shell and a real 2-rank
pool: what they show (the ranks' output, where the run stands, what it kept, what to
type next), ``%%fsdp`` cells seeing the paused script's locals, the journal's lines, and
bad input answered with what to type."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from fsdp_interactive.pool import RankError
from tests.torchrun_reference import SCRIPTS

SCRIPT = SCRIPTS / "plain_fsdp1.py"


def test_run_pause_cells_continue_and_journal(pool_shell, pool, capsys):
    pool_shell.run_line_magic("fsdp", f"run --stop-at 2 {SCRIPT} --steps 4")
    out = capsys.readouterr().out
    assert "step 0: loss" in out and "step 2" not in out
    assert "plain_fsdp1.py paused after 2 optimizer steps; type %fsdp continue" in out
    assert "%fsdp continue --stop to end it" in out
    assert "kept on the ranks: parser (ArgumentParser), args (Namespace)" in out
    assert "model (FullyShardedDataParallel)" in out

    pool_shell.run_cell_magic("fsdp", "", "print('at', step, type(optimizer).__name__)")
    assert "at 1 AdamW" in capsys.readouterr().out

    with pytest.raises(UsageError, match="has already taken 2 steps; type a later step"):
        pool_shell.run_line_magic("fsdp", "continue --stop-at 1")
    with pytest.raises(UsageError, match="either --stop-at M or --stop"):
        pool_shell.run_line_magic("fsdp", "continue --stop --stop-at 3")
    pool_shell.run_line_magic("fsdp", "continue")
    out = capsys.readouterr().out
    assert "step 3: loss" in out and "plain_fsdp1.py ended after 4 optimizer steps" in out

    pool_shell.run_line_magic("fsdp", "journal --last 3")
    out = capsys.readouterr().out
    assert "%fsdp run --stop-at 2" in out and "%fsdp continue" in out


def test_a_failing_script_fails_the_magic_and_says_what_it_kept(
    pool_shell, pool, capsys, tmp_path: Path
):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            def main():
                weights = torch.ones(3)
                raise RuntimeError("bad batch")
            main()
            """
        )
    )
    with pytest.raises(Exception) as failed:
        pool_shell.run_line_magic("fsdp", f"run {script}")
    rendered = "\n".join(failed.value._render_traceback_())
    assert "RuntimeError: bad batch" in rendered and "fails.py" in rendered
    assert "%fsdp debug" in rendered
    out = capsys.readouterr().out
    assert "fails.py failed after 0 optimizer steps" in out
    assert "kept on the ranks: weights (Tensor (3,) float32)" in out

    # options of %fsdp run after the script's path reach the script: said so
    with pytest.raises(RankError, match="SystemExit: 2"):
        pool_shell.run_line_magic("fsdp", f"run {SCRIPT} --stop-at 2")
    assert "options of %fsdp run go before the script's path" in capsys.readouterr().out


def test_bad_run_input_names_what_to_type(pool_shell, pool, tmp_path: Path):
    with pytest.raises(UsageError, match="usage: %fsdp run"):
        pool_shell.run_line_magic("fsdp", "run")
    with pytest.raises(UsageError, match=r"no script 'missing\.py'"):
        pool_shell.run_line_magic("fsdp", "run missing.py")
    with pytest.raises(UsageError, match="--stop-at 0: type a step number >= 1"):
        pool_shell.run_line_magic("fsdp", f"run --stop-at 0 {SCRIPT}")
    with pytest.raises(UsageError, match="--targets 7"):
        pool_shell.run_line_magic("fsdp", f"run --targets 7 {SCRIPT}")
    with pytest.raises(UsageError, match="no script run is paused; start one with %fsdp run"):
        pool_shell.run_line_magic("fsdp", "continue")


def test_export_magic_dry_run_writes_and_refusals(pool_shell, pool, capsys, tmp_path: Path):
    pool_shell.run_line_magic("fsdp", "restart")
    pool_shell.user_ns["lr"] = 0.25
    pool_shell.run_line_magic("fsdp", "push lr")
    pool_shell.run_cell_magic("fsdp", "", "weights = torch.full((3,), lr)")
    pool_shell.run_cell_magic("fsdp", "--export train", "weights.mul_(2)")
    capsys.readouterr()

    pool_shell.run_line_magic("fsdp", f"export {tmp_path / 'job.py'} --dry-run")
    out = capsys.readouterr().out
    assert "would export" in out and "push lr: values pushed from the kernel: lr" in out
    assert ": training cell" in out and "run it: " in out and "--nproc-per-node 2" in out
    assert not (tmp_path / "job.py").exists()

    pool_shell.run_line_magic("fsdp", f"export {tmp_path / 'job.py'} --sbatch --nodes 2")
    out = capsys.readouterr().out
    assert "exported" in out and "sbatch " in out
    assert "the job has 4 ranks, the notebook 2" in out
    assert "#SBATCH --nodes=2" in (tmp_path / "job.sbatch").read_text()

    pool_shell.run_cell_magic("fsdp", "--local", "also_here = 1")
    with pytest.raises(Exception) as refused:
        pool_shell.run_line_magic("fsdp", f"export {tmp_path / 'again.py'}")
    rendered = "\n".join(refused.value._render_traceback_())
    assert "ExportRefused" in rendered and "%%fsdp --local" in rendered
    assert "%fsdp export PATH --dry-run" in rendered
    assert "CANNOT CARRY" in capsys.readouterr().out

    with pytest.raises(UsageError, match="either --from-snapshot ID or --from-checkpoint DIR"):
        pool_shell.run_line_magic(
            "fsdp", f"export x.py --from-snapshot s --from-checkpoint {tmp_path}"
        )
    with pytest.raises(UsageError, match="--nodes 0: type a number >= 1"):
        pool_shell.run_line_magic("fsdp", "export x.py --nodes 0")
    with pytest.raises(UsageError, match=r"ending in \.py"):
        pool_shell.run_line_magic("fsdp", "export x.txt")
