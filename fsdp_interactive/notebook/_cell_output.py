"""Per-rank output of a ``%%fsdp`` cell: collecting it and showing it (notebook side).

Default display: the lowest targeted rank's output (stdout, rich displays, last value)
plus every rank's stderr, with identical texts shown once for all ranks that produced
them; stderr is grouped line by line, also while it streams.  ``group_outputs`` ("rank",
"type" or "order", as ipyparallel's ``%%px``) shows every rank.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GROUPINGS = ("rank", "order", "type")


@dataclass
class RankOutput:
    """Everything one rank produced for one cell."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    displays: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None

    def signature(self) -> tuple[Any, ...]:
        return (
            self.stdout,
            self.stderr,
            repr([d.get("data") for d in self.displays]),
            repr(self.result.get("data") if self.result else None),
        )


def outputs_of(sink: StreamSink, result: Any | None, ranks: list[int]) -> dict[int, RankOutput]:
    """Per-rank outputs of a cell: text from the sink, rich output from the ``RunResult``.

    On failure there is no ``RunResult`` (``result=None``): the text the ranks printed
    before failing is still there, rich displays are not.
    """
    outputs = {rank: RankOutput(rank) for rank in ranks}
    for rank, out in outputs.items():
        out.stdout = sink.text(rank, "stdout")
        out.stderr = sink.text(rank, "stderr")
        if result is not None:
            out.displays = list(result.displays.get(rank, []))
            data = result.result_data.get(rank) or {}
            out.result = {"data": data, "metadata": {}} if data else None
    return outputs


def ranks_label(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _tagged(text: str, tag: str) -> str:
    lines = text.splitlines()
    return "".join(f"{tag}{line}\n" for line in lines)


@dataclass
class _HeldLine:
    text: str
    ranks: list[int]
    since: float


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
            if held.text == text:
                held.ranks.append(rank)
                return
        self._held.append(_HeldLine(text, [rank], self._clock()))

    def _release(self, shown: list[str], everything: bool) -> None:
        """Move the held lines that are due, oldest first, to ``shown``."""
        now = self._clock()
        while self._held:
            head = self._held[0]
            due = (
                self._ranks <= set(head.ranks)
                or now - head.since >= self._hold_s
                or len(self._held) > self._max_held
            )
            if not (everything or due):
                break
            self._held.pop(0)
            shown.append(f"[{ranks_label(sorted(head.ranks))}:stderr] {head.text}\n")

    def _show(self, shown: list[str]) -> None:
        if shown:
            self._write("".join(shown))


def _grouped_stderr(outputs: list[RankOutput]) -> str:
    """Every rank's whole stderr, identical lines once with their ranks."""
    text: list[str] = []
    lines = StderrLines([o.rank for o in outputs], text.append, hold_s=math.inf)
    for out in outputs:
        lines.add(out.rank, out.stderr)
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


def show_outputs(
    outputs: dict[int, RankOutput],
    group_outputs: str | None,
    streamed: bool,
    display: Display | None = None,
) -> None:
    """Show a finished cell's outputs; text that was streamed is not shown again."""
    shown = display or Display()
    ordered = [outputs[r] for r in sorted(outputs)]
    if not ordered:
        return
    if group_outputs is None:
        first = ordered[0]
        if not streamed:
            shown.stdout(first.stdout)
            shown.stderr(_grouped_stderr(ordered))
        different = [o.rank for o in ordered[1:] if o.stdout != first.stdout and o.stdout]
        if different:
            shown.stdout(
                f"[{ranks_label(different)} printed other output; "
                "%%fsdp --group-outputs rank shows every rank]\n"
            )
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
            if out.displays or out.result:
                shown.stdout(f"[{label}: output]\n")
            for content in out.displays:
                shown.rich(content)
            if out.result:
                shown.rich(out.result)
        return
    if not streamed:
        for ranks, out in _groups(ordered, lambda o: o.stdout):
            shown.stdout(_tagged(out.stdout, f"[{ranks_label(ranks)}] "))
        shown.stderr(_grouped_stderr(ordered))
    if group_outputs == "order":
        depth = max(len(o.displays) for o in ordered)
        for index in range(depth):
            present = [o for o in ordered if index < len(o.displays)]
            key = lambda o, i=index: repr(o.displays[i].get("data"))  # noqa: E731
            for ranks, out in _groups(present, key):
                shown.stdout(f"[{ranks_label(ranks)}: output {index}]\n")
                shown.rich(out.displays[index])
    else:
        for ranks, out in _groups(ordered, lambda o: repr([d.get("data") for d in o.displays])):
            if out.displays:
                shown.stdout(f"[{ranks_label(ranks)}: output]\n")
            for content in out.displays:
                shown.rich(content)
    for ranks, out in _groups(ordered, lambda o: repr(o.result.get("data") if o.result else None)):
        if out.result:
            shown.stdout(f"[{ranks_label(ranks)}: result]\n")
            shown.rich(out.result)


class StreamSink:
    """``on_output`` for ``Pool.run``: keeps every rank's text and, when live, prints it.

    Live printing shows what the chosen display shows, as it arrives: by default the
    lowest targeted rank's stdout untagged; with a grouping, every rank's stdout lines
    tagged ``[rank N]``; in both, the stderr of ``ranks`` grouped line by line
    (:class:`StderrLines`).  ``text(rank, name)`` is everything received.
    """

    def __init__(self, ranks: list[int], all_ranks: bool, live: bool = True):
        from fsdp_interactive.pool import TaggedPrinter

        self.first_rank = min(ranks)
        self.all_ranks = all_ranks
        self.live = live
        self._received: dict[tuple[int, str], list[str]] = {}
        self._tagged = TaggedPrinter()
        self._stderr = StderrLines(ranks, self._write_stderr)

    @staticmethod
    def _write_stderr(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    def __call__(self, rank: int, name: str, text: str) -> None:
        self._received.setdefault((rank, name), []).append(text)
        if not self.live:
            return
        if name == "stderr":
            self._stderr.add(rank, text)
            return
        if not self.all_ranks:
            if rank == self.first_rank:
                sys.stdout.write(text)
                sys.stdout.flush()
            return
        self._tagged(rank, name, text)

    def text(self, rank: int, name: str) -> str:
        return "".join(self._received.get((rank, name), []))

    def flush(self) -> None:
        if self.live:
            self._tagged.flush()
            self._stderr.flush()
            sys.stdout.flush()
