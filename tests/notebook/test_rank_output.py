"""What the ranks show in a ``%%fsdp`` cell, through a real IPython shell (a terminal's
transcript) against a real 2-rank pool: progress bars and ``\\r`` counters move in place
while the cell runs, and other ranks' displays are announced."""

from __future__ import annotations

import io
import sys

import pytest
from IPython.utils.capture import capture_output

from fsdp_interactive._lines import final_lines
from tests.notebook.gates import Gates, gated_loop

pytestmark = pytest.mark.timing

STEPS = 4


class Transcript(io.StringIO):
    """A terminal's stream: keeps everything written and shows it to ``gates``."""

    def __init__(self, gates: Gates | None = None) -> None:
        super().__init__()
        self.gates = gates

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.gates is not None:
            self.gates.observe(text)
        return written


def screen(transcript: str) -> list[str]:
    """The lines a terminal shows once ``transcript`` was written (a carriage return
    rewrites the line), without trailing blanks."""
    return [line.text.rstrip() for line in final_lines(transcript) if line.text.strip()]


def run_gated(shell, monkeypatch, tmp_path, line: str, bar: str, stream: str = "stderr", body=""):
    """Run a gated loop in a ``%%fsdp`` cell; (the gates, the transcript of ``stream``)."""
    gates = Gates(tmp_path, STEPS)
    watched = Transcript(gates)
    monkeypatch.setattr(sys, stream, watched)
    try:
        shell.run_cell_magic("fsdp", line, gated_loop(tmp_path, STEPS, bar, body))
    finally:
        gates.close()
        monkeypatch.undo()
    return gates, watched.getvalue()


def test_a_plain_tqdm_bar_moves_in_place_while_the_cell_runs(
    pool_shell, pool, monkeypatch, tmp_path
):
    pool_shell.run_cell_magic("fsdp", "--no-stream", "from tqdm import tqdm")
    gates, transcript = run_gated(
        pool_shell,
        monkeypatch,
        tmp_path,
        "--stream",
        "tqdm(RANGE, desc=f'steps of rank {rank}', mininterval=0)",
    )
    assert gates.opened_by_sight == list(range(STEPS)), transcript  # each step seen live
    assert f"\rsteps of rank 0:  50%|█████     | 2/{STEPS}" in transcript
    shown = screen(transcript)
    bars = [line for line in shown if "steps of rank" in line]
    # one final line, untagged like rank 0's prints; rank 1's bar is not shown by default
    assert len(bars) == 1 and bars[0].startswith(f"steps of rank 0: 100%|██████████| {STEPS}/"), (
        shown
    )


def test_every_ranks_bar_ends_on_its_own_tagged_line_with_group_outputs_rank(
    pool_shell, pool, monkeypatch, tmp_path
):
    pool_shell.run_cell_magic("fsdp", "--no-stream", "from tqdm import tqdm")
    gates, transcript = run_gated(
        pool_shell,
        monkeypatch,
        tmp_path,
        "--stream --group-outputs rank",
        "tqdm(RANGE, desc=f'steps of rank {rank}', mininterval=0)",
    )
    assert gates.opened_by_sight == list(range(STEPS)), transcript
    assert f"\r[rank 0:stderr] steps of rank 0:  25%|██▌       | 1/{STEPS}" in transcript
    shown = screen(transcript)
    for rank in (0, 1):
        final = [line for line in shown if f"steps of rank {rank}" in line]
        assert len(final) == 1, shown
        assert final[0].startswith(f"[rank {rank}:stderr] steps of rank {rank}: 100%|"), shown


def test_a_tqdm_auto_bar_moves_as_text_in_a_terminal_shell(pool_shell, pool, monkeypatch, tmp_path):
    pool_shell.run_cell_magic("fsdp", "--no-stream", "from tqdm.auto import tqdm as auto_tqdm")
    gates, transcript = run_gated(
        pool_shell,
        monkeypatch,
        tmp_path,
        "--stream",
        "auto_tqdm(RANGE, desc=f'auto of rank {rank}', mininterval=0)",
    )
    assert gates.opened_by_sight == list(range(STEPS)), transcript
    assert f"\rauto of rank 0:  75%|███████▌  | 3/{STEPS}" in transcript
    shown = screen(transcript)
    bars = [line for line in shown if "auto of rank" in line]
    assert len(bars) == 1 and bars[0].startswith(f"auto of rank 0: 100%|██████████| {STEPS}/"), (
        shown
    )


def test_a_counter_printed_with_a_carriage_return_moves_in_place(
    pool_shell, pool, monkeypatch, tmp_path
):
    gates, transcript = run_gated(
        pool_shell,
        monkeypatch,
        tmp_path,
        "--stream",
        "RANGE",
        stream="stdout",
        body=f"print(f'counted {{i}}/{STEPS}', end='\\r', flush=True)",
    )
    assert gates.opened_by_sight == list(range(STEPS)), transcript
    assert screen(transcript) == [f"counted {STEPS - 1}/{STEPS}"]


def test_the_final_state_of_bars_shows_when_output_is_not_streamed(pool_shell, pool, capsys):
    pool_shell.run_cell_magic(
        "fsdp",
        "--no-stream",
        "from tqdm import tqdm\nfrom tqdm.auto import tqdm as auto_tqdm\n"
        "for _ in tqdm(range(3), desc=f'plain {rank}'):\n    pass\n"
        "for _ in auto_tqdm(range(5), desc=f'auto {rank}'):\n    pass\n",
    )
    _, err = capsys.readouterr()
    assert "\r" not in err
    assert (
        [line for line in err.splitlines() if "plain" in line]
        == [line for line in err.splitlines() if line.startswith("plain 0: 100%|██████████| 3/3 ")]
        != []
    )
    assert (
        [line for line in err.splitlines() if "auto" in line]
        == [line for line in err.splitlines() if line.startswith("auto 0: 100%|██████████| 5/5 ")]
        != []
    )


@pytest.mark.parametrize("rank0_displays", [True, False])
def test_a_display_of_rank_1_is_announced_and_shown_with_group_outputs_rank(
    pool_shell, pool, rank0_displays
):
    code = (
        "from IPython.display import HTML, display\n"
        f"if rank == 1 or {rank0_displays}:\n"
        "    display(HTML(f'<b>table of rank {rank}</b>'))\n"
        "print('the same on every rank')\n"
    )
    with capture_output() as default:
        pool_shell.run_cell_magic("fsdp", "--no-stream", code)
    shown = [o.data.get("text/html") for o in default.outputs]
    assert shown == (["<b>table of rank 0</b>"] if rank0_displays else [])
    note = "[rank 1 displayed other output; %%fsdp --group-outputs rank shows every rank]"
    assert note in default.stdout
    assert "printed other output" not in default.stdout
    with capture_output() as grouped:
        pool_shell.run_cell_magic("fsdp", "--no-stream --group-outputs rank", code)
    shown = [o.data.get("text/html") for o in grouped.outputs]
    expected = ["<b>table of rank 0</b>"] if rank0_displays else []
    assert shown == [*expected, "<b>table of rank 1</b>"]
    assert "[rank 1: output]" in grouped.stdout and "displayed other output" not in grouped.stdout


def test_a_streamed_display_of_rank_0_is_shown_once_in_its_last_state(pool_shell, pool):
    code = (
        "from IPython.display import HTML, display\n"
        "handle = display(HTML('<i>loading</i>'), display_id=True)\n"
        "handle.update(HTML(f'<i>loaded by rank {rank}</i>'))\n"
    )
    with capture_output() as captured:
        pool_shell.run_cell_magic("fsdp", "--stream", code)
    html = [o.data.get("text/html") for o in captured.outputs]
    # a terminal shows the display and then its update; it is not shown again at the end
    assert html == ["<i>loading</i>", "<i>loaded by rank 0</i>"]
    assert "rank 1 displayed other output" in captured.stdout
