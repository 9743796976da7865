"""What a ``%%fsdp`` cell shows while it runs, and the record of everything the ranks sent.

Notebook side. :class:`StreamSink` is the cell's ``on_output`` for ``Pool.run``: every
chunk of every rank's stdout and stderr, and every display a rank publishes, comes here
as it arrives (the pool's output pump). It keeps all of it for the
end of the cell (:func:`._cell_output.outputs_of`) and, when live, shows what the chosen
display shows, as it arrives:

* default: the lowest targeted rank's stdout lines untagged, its progress lines (a line
  rewritten with carriage returns: a plain ``tqdm`` bar, ``print(..., end="\\r")``) and
  its ``tqdm.auto`` bars moving in place untagged, its displays; every rank's stderr
  lines grouped line by line (:class:`._cell_output.StderrLines`);
* with a grouping: every rank's lines tagged ``[rank N]`` (``[rank N:stderr]``), every
  rank's progress lines and bars moving in place, each on its own line, tagged the same
  (displays are shown when the cell ends, grouped).

A running cell's hang notice (ranks waiting in a collective others never reach) is one
more moving line, shown whether or not the cell streams, in magics' words.

Where the moving lines and bars are drawn is :mod:`._live_output`'s choice: displays
updated in place in a Jupyter kernel, the stream's last line elsewhere. Lines are shown
once complete; a partial line without a carriage return waits for its end (or for the
end of the cell).
"""

from __future__ import annotations

from typing import Any

from fsdp_interactive._bar_state import BarState, bar_of
from fsdp_interactive._lines import LineBuffer
from fsdp_interactive.notebook._cell_output import StderrLines
from fsdp_interactive.notebook._live_output import LiveOutput, live_output
from fsdp_interactive.pool import HangNotice, RankDisplay


class StreamSink:
    """``on_output`` for ``Pool.run``: keeps every rank's output and, when live, shows it.

    ``text(rank, name)`` is everything received on that stream; ``displays(rank)`` the
    rank's displays in their last state (updates applied), ``bars(rank)`` the last state
    of each of its ``tqdm.auto`` bars. ``output``: where live output goes (default: the
    surface :func:`._live_output.live_output` picks, made on first use).
    """

    def __init__(
        self,
        ranks: list[int],
        all_ranks: bool,
        live: bool = True,
        output: LiveOutput | None = None,
    ):
        self.first_rank = min(ranks)
        self.all_ranks = all_ranks
        self.live = live
        self._output = output
        self._received: dict[tuple[int, str], list[str]] = {}
        self._displays: dict[int, list[dict[str, Any]]] = {}
        self._display_at: dict[tuple[int, str], int] = {}
        self._bars: dict[int, dict[str, BarState]] = {}
        self._line_buffers: dict[tuple[int, str], LineBuffer] = {}
        self._moving: set[tuple[int, str]] = set()
        self._stderr = StderrLines(ranks, self._write_stderr)

    @property
    def output(self) -> LiveOutput:
        if self._output is None:
            self._output = live_output()
        return self._output

    def _write_stderr(self, text: str) -> None:
        self.output.write("stderr", text)

    def _shows_all_of(self, rank: int) -> bool:
        """Whether the rank's own output (stdout, progress, displays) is shown."""
        return self.all_ranks or rank == self.first_rank

    def _tag(self, rank: int, name: str) -> str:
        if not self.all_ranks:
            return ""
        return f"[rank {rank}] " if name == "stdout" else f"[rank {rank}:{name}] "

    # ------------------------------------------------------------------ streams

    def __call__(self, rank: int, name: str, text: str) -> None:
        self._received.setdefault((rank, name), []).append(text)
        if not self.live:
            return
        key = (rank, name)
        shown = self._shows_all_of(rank)
        if not shown and name == "stdout":
            return  # nothing of it is shown while the cell runs (it is kept above)
        buffer = self._line_buffers.setdefault(key, LineBuffer())
        done = buffer.feed_plain(text) if key not in self._moving else None
        if done is not None:  # the common chunk: whole lines, no carriage return
            self._show_plain_text(rank, name, done)
            return
        tag = self._tag(rank, name)
        plain: list[str] = []
        for line in buffer.feed(text):
            if key in self._moving:
                self._show_plain(rank, name, plain)
                self._moving.discard(key)
                self.output.end_line((rank, "line", name), name, tag + line.text)
            elif line.rewritten:
                if shown:  # a progress line that ended before it was seen moving
                    self._show_plain(rank, name, plain)
                    self._show_finished_progress(rank, name, tag + line.text)
            else:
                plain.append(line.text)
        self._show_plain(rank, name, plain)
        current = buffer.current()
        if shown and current is not None and current.rewritten:
            self._moving.add(key)
            self.output.line((rank, "line", name), name, tag + current.text)

    def _show_plain(self, rank: int, name: str, lines: list[str]) -> None:
        """Show complete lines that are not progress lines (and forget them)."""
        if lines:
            self._show_plain_text(rank, name, "".join(f"{line}\n" for line in lines))
            lines.clear()

    def _show_plain_text(self, rank: int, name: str, text: str) -> None:
        """Show ``text``, complete lines that are not progress lines."""
        if not text:
            return
        if name == "stderr":
            self._stderr.add(rank, text)
        elif self.all_ranks:
            tag = self._tag(rank, name)
            self.output.write(name, "".join(f"{tag}{line}\n" for line in text.split("\n")[:-1]))
        elif rank == self.first_rank:
            self.output.write(name, text)

    def _show_finished_progress(self, rank: int, name: str, text: str) -> None:
        if name == "stderr" and not self.all_ranks:
            self._stderr.add_verbatim(rank, text)
        else:
            self.output.write(name, text + "\n")

    # ------------------------------------------------------------------ displays

    def display(self, rank: int, shown: RankDisplay) -> None:
        """A rank's display: a ``tqdm.auto`` bar's state, or a display to keep (and, by
        default, to show at once when it is the lowest rank's)."""
        state = bar_of(shown.data)
        if state is not None and shown.display_id is not None:
            self._bars.setdefault(rank, {})[shown.display_id] = state
            if self.live and self._shows_all_of(rank):
                tag = f"[rank {rank}] " if self.all_ranks else ""
                self.output.bar((rank, "bar", shown.display_id), tag, state)
            return
        content = {"data": shown.data, "metadata": shown.metadata}
        kept = self._displays.setdefault(rank, [])
        at = self._display_at.get((rank, shown.display_id)) if shown.display_id else None
        if shown.update:
            if at is None:
                return  # an update of a display of an earlier cell
            kept[at] = content
        else:
            if shown.display_id is not None:
                self._display_at[(rank, shown.display_id)] = len(kept)
            kept.append(content)
        if self.live and not self.all_ranks and rank == self.first_rank:
            self.output.rich(rank, content, shown.display_id, shown.update)

    # ------------------------------------------------------------------ hang notice

    def hang(self, notice: HangNotice | None) -> None:
        """Show a running cell's hang notice, updated in place (``None``: take it away)."""
        if notice is None:
            self.output.end_line(HangNotice.LINE_KEY, "stderr", None)
        else:
            self.output.line(HangNotice.LINE_KEY, "stderr", notice.text(notebook=True))

    # ------------------------------------------------------------------ record

    def text(self, rank: int, name: str) -> str:
        return "".join(self._received.get((rank, name), []))

    def displays(self, rank: int) -> list[dict[str, Any]]:
        return list(self._displays.get(rank, []))

    def bars(self, rank: int) -> list[BarState]:
        return list(self._bars.get(rank, {}).values())

    def flush(self) -> None:
        """The cell ended: end partial lines, moving lines and open bars, in their last
        state."""
        if not self.live:
            return
        for key in sorted(self._line_buffers):
            rank, name = key
            line = self._line_buffers[key].flush()
            if key in self._moving:
                self._moving.discard(key)
                text = self._tag(rank, name) + line.text if line is not None else None
                self.output.end_line((rank, "line", name), name, text)
            elif line is not None and line.rewritten:
                if self._shows_all_of(rank):
                    self._show_finished_progress(rank, name, self._tag(rank, name) + line.text)
            elif line is not None:
                self._show_plain(rank, name, [line.text])
        self._stderr.flush()
        self.output.close()
