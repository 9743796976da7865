"""``%fsdp attach``, ``status``, ``stacks``, ``trace``, ``pause``, ``%%fsdp``, ``pull``,
``snapshot``, ``resume`` and ``detach`` on a running torchrun job, in a real IPython shell
(``run``, ``continue`` and ``export``, a pool's, refused)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.error import UsageError

from fsdp_interactive.notebook import magics
from fsdp_interactive.pool import JobError
from tests.pool.attach_jobs import SCRIPT, TorchrunJob


@pytest.fixture
def attach_shell(shell: Any) -> Iterator[Any]:
    """The shell with no pool of its own (a session pool of other tests is put back after)."""
    assert magics._magics is not None
    kept, magics._magics.pool = magics._magics.pool, None
    try:
        yield shell
    finally:
        if magics._magics.pool is not None and getattr(magics._magics.pool, "attached", False):
            magics._magics.pool.detach()
        magics._magics.pool = kept


def _out(capsys: Any) -> str:
    return capsys.readouterr().out


def test_the_attach_magics_drive_a_running_job(attach_shell, tmp_path, capsys):
    os.chmod(tmp_path, 0o700)
    stop = tmp_path / "stop"
    shell = attach_shell
    with TorchrunJob(tmp_path, 2, "--stop-file", str(stop), "--step-sleep", "0.05") as job:
        job.wait_attachable()
        with pytest.raises(
            UsageError, match="no job is attached; attach to a running job with %fsdp attach"
        ):
            shell.run_line_magic("fsdp", "pause")
        shell.run_line_magic("fsdp", f"attach {job.job_folder}")
        out = _out(capsys)
        assert out.startswith(
            "attached to job job (2 ranks on 1 host); type %fsdp status to see every rank"
        )

        shell.run_line_magic("fsdp", "status")
        assert re.match(r"job job: 2 ranks, running\nrank +host +pid +step +phase", _out(capsys))
        shell.run_line_magic("fsdp", "stacks")
        out = _out(capsys)
        assert "--- rank 0:" in out and "--- rank 1:" in out and 'attach_train.py", line' in out

        shell.run_cell("%%fsdp\nprint('too early')")
        # the magic's message in magic words, not a traceback of the kit
        out = capsys.readouterr()
        assert "Pause it at a step boundary first with %fsdp pause." in out.out + out.err

        shell.run_line_magic("fsdp", "pause")
        out = _out(capsys)
        assert "paused after step" in out and "%fsdp resume" in out
        shell.run_cell_magic("fsdp", "", "print('step', step, 'rank', dist.get_rank())")
        assert _out(capsys).startswith("step ")
        shell.run_line_magic("fsdp", "pull model[0].bias --as bias")
        assert "bias <- Tensor (32,) float32" in _out(capsys)
        assert tuple(shell.user_ns["bias"].shape) == (32,)
        shell.run_line_magic("fsdp", f"snapshot model optimizer --persist {tmp_path / 'kept'}")
        out = _out(capsys)
        assert out.startswith("took snapshot ") and f"written to {tmp_path / 'kept'}" in out
        shell.run_line_magic("fsdp", "trace")
        assert "all_reduce" in _out(capsys)
        # What only a pool started here does, refused naming what to type instead
        for line, what in ((f"run {SCRIPT}", "given a script to run"), ("export x.py", "exported")):
            with pytest.raises(JobError, match=f"it is not {what} from here") as refused:
                shell.run_line_magic("fsdp", line)
            assert "%fsdp detach" in "\n".join(refused.value._render_traceback_())
        with pytest.raises(UsageError, match="no script run is paused"):
            shell.run_line_magic("fsdp", "continue")

        shell.run_line_magic("fsdp", "resume")
        assert _out(capsys) == "job job runs on\n"
        shell.run_line_magic("fsdp", "detach")
        assert _out(capsys) == "detached from job job; it runs on as if never attached\n"
        assert magics.current_pool() is None
        stop.touch()
        assert job.wait() == 0, job.output()
