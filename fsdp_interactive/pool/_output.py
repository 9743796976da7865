"""Per-rank output of a run: streaming it tagged by rank, and the result object.

While a run is in flight the pool hands what the ranks publish (:mod:`._call_output`) to
an output sink: ``sink(rank, stream_name, text)`` for each chunk of stdout or stderr, as
the rank wrote it (carriage returns included), and ``sink.display(rank, display)`` for
each display or display update (a :class:`RankDisplay`), when the sink has such a
method. :class:`OutputPump` does this for one set of in-flight calls.

The default sink, :class:`TaggedPrinter`, prints complete lines prefixed with
``[rank N]`` (stderr lines go to ``sys.stderr`` with ``[rank N:stderr]``); it prints
from the calling thread, so in a notebook the text lands in the cell that started the
run. A line a rank rewrites with carriage returns (a ``tqdm`` bar, ``print(...,
end="\\r")``) moves in place on the stream's last line, tagged the same, and is printed
in its final state when it ends; so are the bars of ``tqdm.auto`` (displays under
:data:`fsdp_interactive._bar_state.MIME`). Other displays are collected, not printed. A
running call's hang notice (:mod:`.diagnostics._hang_watch`) takes that moving line, on
stderr, while it is shown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from fsdp_interactive._bar_state import MIME, bar_of
from fsdp_interactive._lines import RankLines, final_text, rank_tag
from fsdp_interactive._status_line import StatusLines, standard_stream
from fsdp_interactive.pool._call_output import (
    CallOutput,
    RankDisplay,
    RankText,
    received_metadata,
)
from fsdp_interactive.pool.diagnostics._hang_watch import HangNotice

OutputSink = Callable[[int, str, str], None]

__all__ = [
    "OutputPump",
    "OutputSink",
    "RankDisplay",
    "RunResult",
    "TaggedPrinter",
    "received_metadata",
    "run_result",
]


class OutputPump:
    """Hands what the ranks' in-flight calls published since the last call to a sink.

    ``handles`` maps rank -> single-engine AsyncResult. Each call of the pump passes every
    new chunk of each rank's stdout and stderr to ``sink(rank, stream, text)``, and every
    display to ``sink.display(rank, display)`` if the sink has that method (displays are
    dropped otherwise), each rank's in the order the rank published them. :meth:`close`
    ends the subscription once the calls are done.
    """

    def __init__(self, handles: Mapping[int, Any], sink: OutputSink) -> None:
        self._output = CallOutput(handles)
        self._sink = sink
        self._display: Callable[[int, RankDisplay], None] | None = getattr(sink, "display", None)

    def __call__(self) -> None:
        for rank, item in self._output.take():
            if isinstance(item, RankText):
                self._sink(rank, item.name, item.text)
            elif self._display is not None:
                self._display(rank, item)

    def close(self) -> None:
        self._output.close()


class TaggedPrinter:
    """Prints whole lines tagged by rank; progress lines and ``tqdm.auto`` bars move in
    place (``live``; otherwise they are printed in their final state only); ``flush()``
    ends partial lines and live ones.

    The ranks' lines are cut and tagged by :class:`fsdp_interactive._lines.RankLines` and
    drawn on :class:`fsdp_interactive._status_line.StatusLines`, as a cell's are outside
    a kernel."""

    def __init__(
        self, stdout: TextIO | None = None, stderr: TextIO | None = None, *, live: bool = True
    ) -> None:
        self._files = {"stdout": stdout, "stderr": stderr}
        self._live = live
        self._bars: dict[tuple[int, str], str] = {}  # (rank, display id) -> last text
        self._status = StatusLines(self._file)
        self._lines = RankLines(self._status, moves=lambda rank, stream: live)

    def _file(self, name: str) -> TextIO:
        chosen = self._files.get(name)
        return chosen if chosen is not None else standard_stream(name)

    tag = staticmethod(rank_tag)

    def __call__(self, rank: int, name: str, text: str) -> None:
        self._lines.feed(rank, name, text)

    def display(self, rank: int, shown: RankDisplay) -> None:
        """A ``tqdm.auto`` bar's state moves in place like a progress line; other
        displays are not printed."""
        state = bar_of(shown.data)
        if state is None or shown.display_id is None:
            return
        tag = rank_tag(rank, "stdout")
        if state.closed:
            self._bars.pop((rank, shown.display_id), None)
        else:
            self._bars[(rank, shown.display_id)] = tag + state.text
        if state.closed or self._live:
            self._status.bar((rank, "bar", shown.display_id), tag, state)

    def hang(self, notice: HangNotice | None) -> None:
        """Show a running call's hang notice on stderr's moving line, in API calls
        (``None``: take it away)."""
        if notice is None:
            self._status.end(HangNotice.LINE_KEY, "stderr", None)
        else:
            self._status.update(HangNotice.LINE_KEY, "stderr", notice.text(notebook=False))

    def flush(self) -> None:
        """Print what is still buffered: each stream's unfinished last line, and the final state of
        lines that moved in place."""
        self._lines.flush()
        for (rank, display_id), text in sorted(self._bars.items()):
            self._status.end((rank, "bar", display_id), "stderr", text)
        self._bars.clear()
        self._status.close()


@dataclass
class RunResult:
    """What a finished :meth:`Pool.run` returns.

    ``ranks``: the ranks it ran on, in order; ``stdout``/``stderr``: full captured text
    per rank, each line as it finally showed (a line rewritten with carriage returns, a
    progress bar, in its last state); ``results``: per rank, the ``text/plain`` form of the cell's last
    expression value (``None`` when the cell ended with a statement);
    ``result_data``: the full MIME bundle of that value (``{}`` when none);
    ``displays``: per rank, the ``display_data`` contents (``{"data": ..., "metadata":
    ...}``) the code published, e.g. figures, as first published (``tqdm.auto`` bars are
    not among them: their states are drawn while the run streams); ``elapsed``: seconds from submission to
    the last rank finishing. Displays are collected, not shown: showing them is the
    notebook front's choice.
    """

    ranks: list[int]
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    results: dict[int, str | None] = field(default_factory=dict)
    result_data: dict[int, dict[str, Any]] = field(default_factory=dict)
    displays: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    elapsed: float = 0.0

    def output(self, rank: int) -> str:
        """stdout of one rank."""
        return self.stdout.get(rank, "")

    def __repr__(self) -> str:
        return f"RunResult(ranks={self.ranks}, elapsed={self.elapsed:.2f}s)"

    def show(self, file: TextIO | None = None) -> None:
        """Print every rank's stdout and stderr, tagged, grouped by rank."""
        printer = TaggedPrinter(stdout=file, stderr=file, live=False)
        for rank in self.ranks:
            printer(rank, "stdout", self.stdout.get(rank, ""))
            printer(rank, "stderr", self.stderr.get(rank, ""))
        printer.flush()


def plain_result(execute_result: dict[str, Any] | None) -> str | None:
    """The ``text/plain`` entry of an execute_result message content, if any."""
    if not execute_result:
        return None
    data = execute_result.get("data") or {}
    return data.get("text/plain")


def run_result(handles: Mapping[int, Any], elapsed: float) -> RunResult:
    """The :class:`RunResult` of finished ``execute`` calls (rank -> AsyncResult)."""
    result = RunResult(ranks=list(handles), elapsed=elapsed)
    for rank, handle in handles.items():
        metadata = received_metadata(handle)
        result.stdout[rank] = final_text(metadata["stdout"])
        result.stderr[rank] = final_text(metadata["stderr"])
        execute_result = metadata.get("execute_result") or {}
        result.results[rank] = plain_result(execute_result)
        result.result_data[rank] = dict(execute_result.get("data") or {})
        result.displays[rank] = [
            {"data": out.get("data", {}), "metadata": out.get("metadata", {})}
            for out in metadata.get("outputs", [])
            if MIME not in (out.get("data") or {})
        ]
    return result
