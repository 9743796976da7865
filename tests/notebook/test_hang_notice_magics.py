"""The live hang notice of a ``%%fsdp`` cell in a real IPython shell (a terminal's moving
line on stderr, in magics' words) against the shared real 2-rank pool, and its options."""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError

from fsdp_interactive.notebook._magic_io import cell_hang_notice
from tests.notebook.gates import one_sided_barrier, stderr_opening


@pytest.mark.timing
def test_a_cell_whose_rank_0_waits_in_a_barrier_shows_a_notice_until_the_cell_ends(
    pool_shell, pool, tmp_path
):
    arrive = tmp_path / "arrive"
    with stderr_opening(arrive, "possible hang") as stderr:
        result = pool_shell.run_cell("%%fsdp --hang-notice 2\n" + one_sided_barrier(arrive))
    result.raise_error()
    err = stderr.getvalue()
    notice = re.search(r"\r(possible hang: [^\r]*?)\s*\r", err)
    assert notice, f"no notice on stderr: {err[-300:]!r}"
    text = notice.group(1)
    waited = re.match(r"possible hang: rank 0 has waited (\d+) s in barrier #\d+ ", text)
    assert waited and 2 <= int(waited.group(1)) <= 4, text
    assert re.search(
        r"\(Cell In\[\d+\], line 8: dist\.barrier\(\)\); rank 1 finished the cell", text
    )
    assert "then type %fsdp trace." in text and "pool.trace" not in text
    assert re.search(r"\r {100,}\r$", err), f"the notice was not erased: {err[-200:]!r}"


def test_the_hang_notice_options_say_what_to_type(pool_shell, pool):
    with pytest.raises(UsageError, match="either --hang-notice S or --no-hang-notice"):
        pool_shell.run_cell_magic("fsdp", "--hang-notice 5 --no-hang-notice", "x = 1")
    with pytest.raises(UsageError, match=r"--hang-notice 0: type a number of seconds > 0"):
        pool_shell.run_cell_magic("fsdp", "--hang-notice 0", "x = 1")
    with pytest.raises(UsageError, match="%fsdp start: type either"):
        pool_shell.run_line_magic("fsdp", "start --hang-notice 5 --no-hang-notice")
    assert cell_hang_notice(None, True, "%%fsdp") is False
    assert cell_hang_notice(12.5, False, "%%fsdp") == 12.5
    assert cell_hang_notice(None, False, "%%fsdp") is None
