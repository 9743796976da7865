"""Grouping of the ranks' stderr lines, progress lines and notes of a finished cell (no ranks
needed: the lines are fed by hand)."""

from __future__ import annotations

from fsdp_interactive.notebook._cell_output import (
    RankOutput,
    StderrLines,
    other_output_note,
    show_outputs,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def grouper(ranks, hold_s=2.0):
    written: list[str] = []
    clock = Clock()
    return StderrLines(ranks, written.append, hold_s=hold_s, clock=clock), written, clock


def test_a_line_is_written_once_every_rank_has_printed_it():
    lines, written, _ = grouper([0, 1, 2])
    lines.add(0, "warn\n")
    lines.add(2, "wa")
    assert written == []
    lines.add(2, "rn\n")
    lines.add(1, "warn\nnext\n")
    assert "".join(written) == "[ranks 0,1,2:stderr] warn\n"


def test_lines_match_in_each_ranks_own_order_and_keep_it():
    lines, written, _ = grouper([0, 1])
    lines.add(0, "a\nb\na\n")
    lines.add(1, "a\na\n")  # rank 1 never prints b: its second a is rank 0's second a
    lines.flush()
    assert "".join(written) == "[ranks 0,1:stderr] a\n[rank 0:stderr] b\n[ranks 0,1:stderr] a\n"


def test_a_line_the_other_ranks_do_not_print_is_written_after_the_hold():
    lines, written, clock = grouper([0, 1], hold_s=2.0)
    lines.add(0, "only zero\n")
    clock.now = 1.9
    lines.add(0, "")
    assert written == []
    clock.now = 2.0
    lines.add(1, "")
    assert "".join(written) == "[rank 0:stderr] only zero\n"


def test_a_rank_flooding_stderr_keeps_only_the_newest_lines_waiting():
    written: list[str] = []
    lines = StderrLines([0, 1], written.append, hold_s=60.0, clock=Clock(), max_held=3)
    lines.add(0, "".join(f"line {i}\n" for i in range(10)))
    assert "".join(written) == "".join(f"[rank 0:stderr] line {i}\n" for i in range(7))
    lines.add(1, "line 7\n")
    assert written[-1] == "[ranks 0,1:stderr] line 7\n"


def test_flush_writes_partial_lines_and_everything_held():
    lines, written, _ = grouper([0, 1])
    lines.add(1, "done\nno newline")
    lines.add(0, "no newline")
    assert written == []
    lines.flush()
    assert "".join(written) == "[rank 1:stderr] done\n[ranks 0,1:stderr] no newline\n"


class Recorded:
    def __init__(self) -> None:
        self.err = ""
        self.out = ""

    def stdout(self, text: str) -> None:
        self.out += text

    def stderr(self, text: str) -> None:
        self.err += text

    def rich(self, content) -> None:
        raise AssertionError("no rich output expected")


def test_a_finished_cell_groups_stderr_line_by_line():
    outputs = {
        0: RankOutput(0, stderr="same\nmine 0\n"),
        1: RankOutput(1, stderr="same\nmine 1\n"),
    }
    for grouping in (None, "type"):
        shown = Recorded()
        show_outputs(outputs, grouping, streamed=False, display=shown)
        assert shown.err == (
            "[ranks 0,1:stderr] same\n[rank 0:stderr] mine 0\n[rank 1:stderr] mine 1\n"
        )


def test_a_finished_cell_shows_progress_lines_in_their_final_state():
    outputs = {
        0: RankOutput(0, stdout="epoch 1\n", stderr="warn\n\rbar  0%\rbar 100%\n"),
        1: RankOutput(1, stdout="epoch 1\n", stderr="warn\n\rbar  0%\rbar 100% (rank 1)\n"),
    }
    shown = Recorded()
    show_outputs(outputs, None, streamed=False, display=shown)
    # rank 0's bar, untagged like its prints; rank 1's runs the same loop and is not announced
    assert shown.err == "[ranks 0,1:stderr] warn\nbar 100%\n"
    assert shown.out == "epoch 1\n"
    grouped = Recorded()
    show_outputs(outputs, "rank", streamed=False, display=grouped)
    assert "[rank 0:stderr] bar 100%\n" in grouped.err
    assert "[rank 1:stderr] bar 100% (rank 1)\n" in grouped.err
    assert "\r" not in grouped.err + grouped.out


def test_the_note_names_ranks_that_printed_or_displayed_something_else():
    assert other_output_note([], []) == ""
    tail = "; %%fsdp --group-outputs rank shows every rank]\n"
    assert other_output_note([1], []) == "[rank 1 printed other output" + tail
    assert other_output_note([], [2, 3]) == "[ranks 2,3 displayed other output" + tail
    assert other_output_note([1, 2], [2]) == (
        "[rank 2 printed and displayed other output, rank 1 printed other output" + tail
    )
