"""What a notebook shows when a plain cell's ``pool.run`` fails, through a real IPython
shell against the session's 2-rank pool: the error's type and message, as ``%%fsdp``
shows them, without the pool's own frames (``_pool.py``, ``_dispatch.py``,
``_faults.py``) before it."""

from __future__ import annotations


def test_a_pool_run_error_in_a_plain_cell_shows_no_frame_of_the_pool(pool_shell, pool, capsys):
    capsys.readouterr()
    result = pool_shell.run_cell(
        "from fsdp_interactive.notebook import current_pool\n"
        "current_pool().run(\"raise ValueError('bad value')\", stream=False)"
    )
    assert result.error_in_exec is not None
    shown = capsys.readouterr().out
    assert shown.lstrip().startswith("RankError: ranks 0, 1 raised"), shown
    assert "ValueError: bad value" in shown and "pool.debug(0" in shown
    for frame in ("_pool.py", "_dispatch.py", "_faults.py", "_live_group.py"):
        assert frame not in shown, shown
