"""A rank's death in a ``%%fsdp`` cell, through a real IPython shell against a real 2-rank
pool: the report holds what the dead rank wrote during the cell that died (its output and
its engine log since it took the cell), and says so when it wrote nothing; nothing of
earlier cells, nor ipyparallel's own log lines."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from fsdp_interactive.pool import RankDied
from tests.notebook.gates import held_until

pytestmark = pytest.mark.timing


def _touch_when_received(pool, texts: dict[str, str], path: Path) -> threading.Thread:
    """Create ``path`` once one request's record in the pool's client holds each of
    ``texts`` (stream name -> text): what a death report reads of a rank's output."""
    client = pool._live.client

    def received() -> bool:
        for _ in range(10):  # the client's I/O thread adds records meanwhile
            try:
                records = list(client.metadata.values())
                break
            except RuntimeError:
                continue
        else:
            return False
        return any(
            all(text in (record.get(name) or "") for name, text in texts.items())
            for record in records
            if isinstance(record, dict)
        )

    def watch() -> None:
        deadline = time.monotonic() + 300
        while not received() and time.monotonic() < deadline:
            time.sleep(0.02)
        path.touch()  # also after the deadline: the rank then dies, the test says what lacked

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _death_text(result) -> str:
    error = result.error_in_exec
    assert isinstance(error, RankDied), error
    return "\n".join(error._render_traceback_())


def test_a_death_report_holds_only_what_the_rank_wrote_during_the_cell_that_died(
    pool_shell, pool, tmp_path
):
    earlier = pool_shell.run_cell(
        "%%fsdp --no-stream\nif rank == 1:\n    raise ValueError('an earlier cell failed')"
    )
    assert not earlier.success
    pool_shell.run_cell("%%fsdp --no-stream\nprint('a cell that worked', rank)")
    # Rank 1 dies once the kernel holds its lines (a line still on its way dies with it).
    received = tmp_path / "received"
    watcher = _touch_when_received(
        pool, {"stdout": "loading shard 1", "stderr": "shard too large 1"}, received
    )
    died = pool_shell.run_cell(
        "%%fsdp --no-stream\n"
        "import os, signal, sys, time\n"
        "print('loading shard', rank, flush=True)\n"
        "print('shard too large', rank, file=sys.stderr, flush=True)\n"
        "os.write(2, b'written below Python by rank %d\\n' % rank)\n"
        "if rank == 1:\n"
        f"    {held_until(received)}\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(120)\n"
    )
    watcher.join(timeout=60)
    text = _death_text(died)
    report = text.split("rank 1 (pid", 1)[1]
    assert f"killed by signal {signal.SIGKILL.name}" in report
    assert (
        "--- what rank 1 printed during this call ---\nloading shard 1\nshard too large 1" in text
    )
    assert "--- rank 1's engine log during this call ---\nwritten below Python by rank 1" in text
    for older in ("ValueError", "an earlier cell failed", "a cell that worked", "Handling"):
        assert older not in text, text


def test_a_death_report_says_when_the_rank_wrote_nothing_during_the_cell(pool_shell, pool):
    pool_shell.run_cell("%%fsdp --no-stream\nprint('an earlier cell', rank)")
    died = pool_shell.run_cell(
        "%%fsdp --no-stream\nimport os, signal, time\n"
        "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(120)\n"
    )
    text = _death_text(died)
    assert "--- rank 1 wrote nothing during this call ---" in text
    assert "an earlier cell" not in text and "Handling" not in text
