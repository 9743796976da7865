"""Per-rank output of a ``%%fsdp`` cell: collecting it and showing it (notebook side).

Default display: the lowest targeted rank's output (stdout, rich displays, last value)
plus every rank's stderr, with identical texts shown once for all ranks that produced
them.  ``group_outputs`` ("rank", "type" or "order", as ipyparallel's ``%%px``) shows
every rank.
"""

from __future__ import annotations

import sys
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
            for ranks, out in _groups(ordered, lambda o: o.stderr):
                if out.stderr:
                    shown.stderr(_tagged(out.stderr, f"[{ranks_label(ranks)}:stderr] "))
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
        for ranks, out in _groups(ordered, lambda o: o.stderr):
            shown.stderr(_tagged(out.stderr, f"[{ranks_label(ranks)}:stderr] "))
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
    lowest targeted rank's stdout untagged and every rank's stderr tagged; with a grouping,
    every rank's lines tagged ``[rank N]``.  ``text(rank, name)`` is everything received.
    """

    def __init__(self, first_rank: int, all_ranks: bool, live: bool = True):
        from fsdp_interactive.pool import TaggedPrinter

        self.first_rank = first_rank
        self.all_ranks = all_ranks
        self.live = live
        self._received: dict[tuple[int, str], list[str]] = {}
        self._tagged = TaggedPrinter()

    def __call__(self, rank: int, name: str, text: str) -> None:
        self._received.setdefault((rank, name), []).append(text)
        if not self.live:
            return
        if name == "stdout" and not self.all_ranks:
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
            sys.stdout.flush()
