"""Per-rank output of a ``%%fsdp`` cell, shown when the cell ends (notebook side).

Default display: the lowest targeted rank's output (stdout, progress bars, rich
displays, last value) plus every rank's stderr, with identical texts shown once for all
ranks that produced them; stderr is grouped line by line, also while it streams
(:mod:`._stream_sink` shows output as it arrives). What other ranks printed or displayed
differently is announced in one line that names ``--group-outputs rank``; their progress
lines and bars are not (every rank runs the same loop). ``group_outputs`` ("rank",
"type" or "order", as ipyparallel's ``%%px``) shows every rank.

Text is shown as it finally looks: a line a rank rewrote with carriage returns (a
progress bar) in its last state (:mod:`fsdp_interactive._lines`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fsdp_interactive._bar_state import BarState
from fsdp_interactive._lines import final_lines, final_text, plain_text

GROUPINGS = ("rank", "order", "type")


@dataclass
class RankOutput:
    """Everything one rank produced for one cell: its text as received, its displays in
    their last state, its ``tqdm.auto`` bars' last states, its last value."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    displays: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    bars: list[BarState] = field(default_factory=list)

    def signature(self) -> tuple[Any, ...]:
        return (
            final_text(self.stdout),
            final_text(self.stderr),
            repr([d.get("data") for d in self.displays]),
            repr(self.result.get("data") if self.result else None),
            repr([bar.text for bar in self.bars]),
        )


class CellRecord(Protocol):
    """What a cell's output sink kept of every rank (:class:`._stream_sink.StreamSink`)."""

    def text(self, rank: int, name: str) -> str: ...

    def displays(self, rank: int) -> list[dict[str, Any]]: ...

    def bars(self, rank: int) -> list[BarState]: ...


def outputs_of(sink: CellRecord, result: Any | None, ranks: list[int]) -> dict[int, RankOutput]:
    """Per-rank outputs of a cell: text, displays and bars from the sink, the last value
    from the ``RunResult``.

    On failure there is no ``RunResult`` (``result=None``): what the ranks printed and
    displayed before failing is still there, their last values are not.
    """
    outputs = {rank: RankOutput(rank) for rank in ranks}
    for rank, out in outputs.items():
        out.stdout = sink.text(rank, "stdout")
        out.stderr = sink.text(rank, "stderr")
        out.displays = sink.displays(rank)
        out.bars = sink.bars(rank)
        if result is not None:
            data = result.result_data.get(rank) or {}
            out.result = {"data": data, "metadata": {}} if data else None
    return outputs


def ranks_label(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _tagged(text: str, tag: str) -> str:
    return "".join(f"{tag}{line.text}\n" for line in final_lines(text))


@dataclass
class _HeldLine:
    text: str
    ranks: list[int]
    since: float
    #: written as it is, not matched with other ranks' lines (a progress line)
    verbatim: bool = False


class StderrLines:
    """Shows the ranks' stderr line by line, each line once with the ranks that printed it.

    ``add(rank, text)`` takes a chunk of one rank's stderr; complete lines are held until
    every rank in ``ranks`` has printed the same line (matched in each rank's own order),
    then written once as ``[ranks 0,1:stderr] line``.  A line that the other ranks have not
    printed after ``hold_s`` seconds is written with the ranks that did, when more output
    arrives (``add``) or at ``flush()``, which writes everything held, partial lines
    included.  Lines are written in the order they were first printed, so each rank's own
    order is kept.  At most ``max_held`` lines wait at once (the oldest is written first),
    which bounds the matching work when one rank floods stderr.  Nothing here runs on a
    timer: without further output a line printed by only some ranks waits for ``flush()``.
    """

    def __init__(
        self,
        ranks: list[int],
        write: Callable[[str], None],
        hold_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        max_held: int = 200,
    ):
        self._ranks = set(ranks)
        self._write = write
        self._hold_s = hold_s
        self._max_held = max_held
        self._clock = clock
        self._partial: dict[int, str] = {}
        self._held: list[_HeldLine] = []

    def add(self, rank: int, text: str) -> None:
        *lines, rest = (self._partial.pop(rank, "") + text).split("\n")
        if rest:
            self._partial[rank] = rest
        shown: list[str] = []
        for line in lines:
            self._hold(rank, line)
            self._release(shown, everything=False)
        self._release(shown, everything=False)
        self._show(shown)

    def add_verbatim(self, rank: int, text: str) -> None:
        """Write ``text`` (one line, without ``"\\n"``) as it is, after what is held."""
        self._held.append(_HeldLine(text, [rank], self._clock(), verbatim=True))
        shown: list[str] = []
        self._release(shown, everything=False)
        self._show(shown)

    def flush(self) -> None:
        for rank, rest in sorted(self._partial.items()):
            self._hold(rank, rest)
        self._partial.clear()
        shown: list[str] = []
        self._release(shown, everything=True)
        self._show(shown)

    def _hold(self, rank: int, text: str) -> None:
        start = 0
        for index in range(len(self._held) - 1, -1, -1):
            if rank in self._held[index].ranks:
                start = index + 1
                break
        for held in self._held[start:]:
            if held.text == text and not held.verbatim:
                held.ranks.append(rank)
                return
        self._held.append(_HeldLine(text, [rank], self._clock()))

    def _release(self, shown: list[str], everything: bool) -> None:
        """Move the held lines that are due, oldest first, to ``shown``."""
        now = self._clock()
        while self._held:
            head = self._held[0]
            due = (
                head.verbatim
                or self._ranks <= set(head.ranks)
                or now - head.since >= self._hold_s
                or len(self._held) > self._max_held
            )
            if not (everything or due):
                break
            self._held.pop(0)
            if head.verbatim:
                shown.append(f"{head.text}\n")
            else:
                shown.append(f"[{ranks_label(sorted(head.ranks))}:stderr] {head.text}\n")

    def _show(self, shown: list[str]) -> None:
        if shown:
            self._write("".join(shown))


def _grouped_stderr(outputs: list[RankOutput], progress_of: int | None = None) -> str:
    """Every rank's whole stderr, identical lines once with their ranks; progress lines
    in their final state, untagged, of rank ``progress_of`` only (``None``: tagged as the
    other lines, of every rank)."""
    text: list[str] = []
    lines = StderrLines([o.rank for o in outputs], text.append, hold_s=math.inf)
    for out in outputs:
        for line in final_lines(out.stderr):
            if not line.rewritten or progress_of is None:
                lines.add(out.rank, line.text + "\n")
            elif out.rank == progress_of:
                lines.add_verbatim(out.rank, line.text)
    lines.flush()
    return "".join(text)


def _groups(
    outputs: list[RankOutput], key: Callable[[RankOutput], Any]
) -> list[tuple[list[int], RankOutput]]:
    found: dict[Any, list[RankOutput]] = {}
    for out in outputs:
        found.setdefault(key(out), []).append(out)
    groups = [([o.rank for o in members], members[0]) for members in found.values()]
    return sorted(groups, key=lambda g: g[0][0])


class Display:
    """Where shown output goes; the IPython display functions by default."""

    def stdout(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def stderr(self, text: str) -> None:
        if text:
            sys.stderr.write(text)
            sys.stderr.flush()

    def rich(self, content: dict[str, Any]) -> None:
        from IPython.display import publish_display_data

        publish_display_data(data=content.get("data", {}), metadata=content.get("metadata", {}))

    def bar(self, tag: str, state: BarState) -> None:
        """A rank's ``tqdm.auto`` bar in its last state: a widget bar in a Jupyter kernel,
        a line of text elsewhere."""
        from fsdp_interactive.notebook._live_output import WidgetBar, in_kernel

        if in_kernel():
            WidgetBar(tag, state)
        else:
            self.stderr(f"{tag}{state.text}\n")


def _kept(bars: list[BarState]) -> list[BarState]:
    """The bars whose last state stays shown (not those closed with ``leave=False``)."""
    return [bar for bar in bars if bar.leave or not bar.closed]


def _displayed(out: RankOutput) -> str:
    return repr([d.get("data") for d in out.displays])


def other_output_note(printed: list[int], displayed: list[int]) -> str:
    """The line that says which ranks printed or displayed what the default hides
    ("" when none did)."""
    both = sorted(set(printed) & set(displayed))
    parts = [f"{ranks_label(both)} printed and displayed other output"] if both else []
    only_printed = sorted(set(printed) - set(both))
    only_displayed = sorted(set(displayed) - set(both))
    if only_printed:
        parts.append(f"{ranks_label(only_printed)} printed other output")
    if only_displayed:
        parts.append(f"{ranks_label(only_displayed)} displayed other output")
    if not parts:
        return ""
    return f"[{', '.join(parts)}; %%fsdp --group-outputs rank shows every rank]\n"


def show_outputs(
    outputs: dict[int, RankOutput],
    group_outputs: str | None,
    streamed: bool,
    display: Display | None = None,
) -> None:
    """Show a finished cell's outputs; what was streamed (text, bars, and by default the
    lowest rank's displays) is not shown again."""
    shown = display or Display()
    ordered = [outputs[r] for r in sorted(outputs)]
    if not ordered:
        return
    if group_outputs is None:
        first = ordered[0]
        if not streamed:
            shown.stdout(final_text(first.stdout))
            shown.stderr(_grouped_stderr(ordered, progress_of=first.rank))
            for bar in _kept(first.bars):
                shown.bar("", bar)
        printed = [
            o.rank
            for o in ordered[1:]
            if plain_text(o.stdout) and plain_text(o.stdout) != plain_text(first.stdout)
        ]
        displayed = [
            o.rank for o in ordered[1:] if o.displays and _displayed(o) != _displayed(first)
        ]
        shown.stdout(other_output_note(printed, displayed))
        if not streamed:
            for content in first.displays:
                shown.rich(content)
        if first.result:
            shown.rich(first.result)
        return
    if group_outputs == "rank":
        for ranks, out in _groups(ordered, RankOutput.signature):
            label = ranks_label(ranks)
            if not streamed:
                shown.stdout(_tagged(out.stdout, f"[{label}] "))
                shown.stderr(_tagged(out.stderr, f"[{label}:stderr] "))
                for bar in _kept(out.bars):
                    shown.bar(f"[{label}] ", bar)
            if out.displays or out.result:
                shown.stdout(f"[{label}: output]\n")
            for content in out.displays:
                shown.rich(content)
            if out.result:
                shown.rich(out.result)
        return
    if not streamed:
        for ranks, out in _groups(ordered, lambda o: final_text(o.stdout)):
            shown.stdout(_tagged(out.stdout, f"[{ranks_label(ranks)}] "))
        shown.stderr(_grouped_stderr(ordered))
        for out in ordered:
            for bar in _kept(out.bars):
                shown.bar(f"[rank {out.rank}] ", bar)
    if group_outputs == "order":
        depth = max(len(o.displays) for o in ordered)
        for index in range(depth):
            present = [o for o in ordered if index < len(o.displays)]
            key = lambda o, i=index: repr(o.displays[i].get("data"))  # noqa: E731
            for ranks, out in _groups(present, key):
                shown.stdout(f"[{ranks_label(ranks)}: output {index}]\n")
                shown.rich(out.displays[index])
    else:
        for ranks, out in _groups(ordered, _displayed):
            if out.displays:
                shown.stdout(f"[{ranks_label(ranks)}: output]\n")
            for content in out.displays:
                shown.rich(content)
    for ranks, out in _groups(ordered, lambda o: repr(o.result.get("data") if o.result else None)):
        if out.result:
            shown.stdout(f"[{ranks_label(ranks)}: result]\n")
            shown.rich(out.result)
