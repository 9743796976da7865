"""Lines as Jupyter and a terminal show them (carriage returns rewrite the current line),
and lines that move in place on a text stream; fed by hand, no ranks needed."""

from __future__ import annotations

import io

from fsdp_interactive._lines import Line, LineBuffer, final_lines, final_text, plain_text
from fsdp_interactive._status_line import StatusLines


def test_a_carriage_return_replaces_the_whole_line_as_jupyter_shows_it():
    assert final_text("loading\rdone\n") == "done\n"
    assert final_text("a long line\rshort\n") == "short\n"
    assert final_text("step 3\r\n") == "step 3\n"  # a line ending in \r keeps its text
    assert final_text("kept\nx\ry") == "kept\ny"
    assert final_text("no carriage return\n") == "no carriage return\n"


def test_progress_lines_are_told_from_plain_ones():
    lines = final_lines("epoch 1\n\r 0%\r50%\r100%\nwindows line\r\n")
    assert lines == [
        Line("epoch 1", False),
        Line("100%", True),
        Line("windows line", False),
    ]
    assert plain_text("epoch 1\n\r 0%\r50%\r100%\nepoch 2") == "epoch 1\nepoch 2\n"


def test_a_buffer_completes_lines_across_chunks_and_shows_the_current_one():
    buffer = LineBuffer()
    assert buffer.feed("\rbar  0%") == []
    assert buffer.current() == Line("bar  0%", True)
    assert buffer.feed("\rbar 50%") == []
    assert buffer.current() == Line("bar 50%", True)
    assert buffer.feed("\rbar 100%\nnext") == [Line("bar 100%", True)]
    assert buffer.current() == Line("next", False)
    assert buffer.feed(" line\n") == [Line("next line", False)]
    assert buffer.current() is None
    assert buffer.feed("count 1\r") == []
    assert buffer.current() == Line("count 1", True)  # print(..., end="\r") moves
    assert buffer.flush() == Line("count 1", True)
    assert buffer.flush() is None


class Files:
    def __init__(self) -> None:
        self.out = io.StringIO()
        self.err = io.StringIO()

    def __call__(self, name: str) -> io.StringIO:
        return self.err if name == "stderr" else self.out


def shows(text: str) -> list[str]:
    return [line.text.rstrip() for line in final_lines(text) if line.text.strip()]


def test_one_line_moves_and_ordinary_text_goes_above_it():
    files = Files()
    status = StatusLines(files)
    status.update("bar", "stderr", "bar 10%")
    status.write("stderr", "a warning\n")
    status.update("bar", "stderr", "bar 50%")
    assert files.err.getvalue().endswith("\rbar 50%")
    status.end("bar", "stderr", "bar 100%")
    assert shows(files.err.getvalue()) == ["a warning", "bar 100%"]


def test_the_lowest_key_moves_and_the_others_show_when_they_end():
    files = Files()
    status = StatusLines(files)
    status.update((1, "stderr"), "stderr", "rank 1 at 10%")
    status.update((0, "stderr"), "stderr", "rank 0 at 5%")
    status.update((1, "stderr"), "stderr", "rank 1 at 20%")
    assert "rank 1 at 20%" not in files.err.getvalue()  # rank 0's line is the one drawn
    status.end((1, "stderr"), "stderr", "rank 1 done")
    status.update((0, "stderr"), "stderr", "rank 0 at 90%")
    status.close()
    assert shows(files.err.getvalue()) == ["rank 1 done", "rank 0 at 90%"]
    assert files.err.getvalue().endswith("\n")


def test_a_line_that_leaves_no_trace_is_erased():
    files = Files()
    status = StatusLines(files)
    status.update("bar", "stderr", "temporary bar")
    status.end("bar", "stderr", None)
    assert shows(files.err.getvalue()) == []
