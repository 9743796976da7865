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

A cell cut short (a rank died, the ranks were interrupted, or the pool recovered by
itself) ends its open bars and moving lines marked as cut (:func:`cut_note`): a bar turns
red and says why, and, after an automatic recovery, the step it went back to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_interactive._bar_state import BarState, bar_of
from fsdp_interactive._lines import RankLines, rank_tag
from fsdp_interactive.notebook._cell_output import StderrLines
from fsdp_interactive.notebook._live_output import LiveOutput, live_output
from fsdp_interactive.pool import HangNotice, RankDied, RankDisplay, RankInterrupted


def cut_note(error: BaseException | None) -> str | None:
    """Why a cell's bars stopped where they are, for a cell that ``error`` cut short:
    ``cut: rank 1 died; recovered to step 40``; ``None`` for an error that leaves the
    ranks running (a timeout, a rank's exception)."""
    recovered = bool(getattr(error, "was_recovered", False))
    if isinstance(error, RankDied):
        ranks = ", ".join(map(str, error.ranks))
        why = f"rank{'s' if len(error.ranks) > 1 else ''} {ranks} died"
    elif isinstance(error, RankInterrupted):
        why = "interrupted"
    elif recovered:
        why = "the ranks were ended"
    else:
        return None
    if recovered:
        step = getattr(error, "recovered_step", None)
        why += "; recovered" + (f" to step {step}" if step is not None else "")
    return f"cut: {why}"


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
        self._stderr = StderrLines(ranks, self._write_stderr)
        self._lines: RankLines | None = None

    @property
    def output(self) -> LiveOutput:
        if self._output is None:
            self._output = live_output()
        return self._output

    @property
    def lines(self) -> RankLines:
        """The ranks' streams cut into lines, shown on :attr:`output` (made on first use)."""
        if self._lines is None:
            self._lines = RankLines(
                self.output,
                tagged=self.all_ranks,
                moves=lambda rank, stream: self._shows_all_of(rank),
                lines=self._show_lines,
            )
        return self._lines

    def _write_stderr(self, text: str) -> None:
        self.output.write("stderr", text)

    def _shows_all_of(self, rank: int) -> bool:
        """Whether the rank's own output (stdout, progress, displays) is shown."""
        return self.all_ranks or rank == self.first_rank

    def _tag(self, rank: int) -> str:
        """The tag of a rank's bars: ``[rank N] `` when every rank is shown."""
        return rank_tag(rank, "stdout") if self.all_ranks else ""

    # ------------------------------------------------------------------ streams

    def __call__(self, rank: int, name: str, text: str) -> None:
        self._received.setdefault((rank, name), []).append(text)
        if not self.live:
            return
        if not self._shows_all_of(rank) and name == "stdout":
            return  # nothing of it is shown while the cell runs (it is kept above)
        self.lines.feed(rank, name, text)

    def _show_lines(self, rank: int, name: str, text: str, progress: bool) -> None:
        """Show complete lines of a rank's stream (``progress``: one progress line that
        ended, shown for a rank whose output is shown)."""
        if progress:
            if self._shows_all_of(rank):
                self._show_finished_progress(rank, name, self.lines.tag(rank, name) + text[:-1])
        elif name == "stderr":
            self._stderr.add(rank, text)
        elif self.all_ranks:
            tag = self.lines.tag(rank, name)
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
                self.output.bar((rank, "bar", shown.display_id), self._tag(rank), state)
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
            self.output.end(HangNotice.LINE_KEY, "stderr", None)
        else:
            self.output.update(HangNotice.LINE_KEY, "stderr", notice.text(notebook=True))

    # ------------------------------------------------------------------ record

    def text(self, rank: int, name: str) -> str:
        return "".join(self._received.get((rank, name), []))

    def displays(self, rank: int) -> list[dict[str, Any]]:
        return list(self._displays.get(rank, []))

    def bars(self, rank: int) -> list[BarState]:
        return list(self._bars.get(rank, {}).values())

    def _cut_bars(self, note: str) -> None:
        """End every open bar as cut, red, saying ``note``."""
        for rank, bars in self._bars.items():
            for display_id, state in list(bars.items()):
                if state.closed:
                    continue
                cut = dataclasses.replace(
                    state,
                    style="danger",
                    closed=True,
                    leave=True,
                    right=f"{state.right} [{note}]",
                    text=f"{state.text} [{note}]",
                )
                bars[display_id] = cut
                if self.live and self._shows_all_of(rank):
                    self.output.bar((rank, "bar", display_id), self._tag(rank), cut)

    def flush(self, error: BaseException | None = None) -> None:
        """The cell ended: end partial lines, moving lines and open bars, in their last
        state; marked as cut when ``error`` (what the cell raised) cut it short."""
        note = cut_note(error)
        if note is not None:
            self._cut_bars(note)
        if not self.live:
            return
        if self._lines is not None:
            self._lines.flush(note)
        self._stderr.flush()
        self.output.close()
