"""Per-rank output of a run: streaming it tagged by rank, and the result object.

While a run is in flight the pool polls each rank's captured stdout/stderr (which the
ipyparallel client accumulates as the engines publish it) and hands every new chunk to
an output sink ``sink(rank, stream_name, text)``. The default sink, :class:`TaggedPrinter`,
prints complete lines prefixed with ``[rank N]`` (stderr lines go to ``sys.stderr``
with ``[rank N:stderr]``); it prints from the calling thread, so in a notebook the text
lands in the cell that started the run. :class:`OutputPump` does the polling for one set
of in-flight calls.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

OutputSink = Callable[[int, str, str], None]

_STREAMS = ("stdout", "stderr")


def received_metadata(handle: Any) -> dict[str, Any]:
    """A single-engine AsyncResult's metadata dict, as received.

    ``AsyncResult.metadata`` parses every timestamp field with dateutil on each access
    until all have arrived, which costs more than a short call's whole round trip; only
    the output fields are read here, so the received dict is used as it is.

    ``AsyncResult._metadata`` is ipyparallel's private list of received dicts (checked on
    ipyparallel 9.0 and 9.2.0); were it gone or shaped otherwise, the public
    ``metadata`` is read instead.
    """
    received = getattr(handle, "_metadata", None)
    if isinstance(received, list) and len(received) == 1 and isinstance(received[0], dict):
        return received[0]
    return handle.metadata


class OutputPump:
    """Hands the output that ranks' in-flight calls produced since the last call to a sink.

    ``handles`` maps rank -> single-engine AsyncResult. Each call of the pump passes every
    new chunk of each rank's stdout and stderr to ``sink(rank, stream, text)``.
    """

    def __init__(self, handles: Mapping[int, Any], sink: OutputSink) -> None:
        self._handles = handles
        self._sink = sink
        self._seen: dict[tuple[int, str], int] = {}

    def __call__(self) -> None:
        for rank, handle in self._handles.items():
            metadata = received_metadata(handle)
            for name in _STREAMS:
                text = metadata[name]
                seen = self._seen.get((rank, name), 0)
                if len(text) > seen:
                    self._seen[(rank, name)] = len(text)
                    self._sink(rank, name, text[seen:])


class TaggedPrinter:
    """Prints whole lines tagged by rank; ``flush()`` ends partial lines."""

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self._files = {"stdout": stdout, "stderr": stderr}
        self._partial: dict[tuple[int, str], str] = {}

    def _file(self, name: str) -> TextIO:
        chosen = self._files.get(name)
        if chosen is not None:
            return chosen
        return sys.stderr if name == "stderr" else sys.stdout

    @staticmethod
    def tag(rank: int, name: str) -> str:
        return f"[rank {rank}] " if name == "stdout" else f"[rank {rank}:{name}] "

    def __call__(self, rank: int, name: str, text: str) -> None:
        buffered = self._partial.pop((rank, name), "") + text
        *lines, rest = buffered.split("\n")
        if rest:
            self._partial[(rank, name)] = rest
        if lines:
            out = self._file(name)
            out.write("".join(f"{self.tag(rank, name)}{line}\n" for line in lines))
            out.flush()

    def flush(self) -> None:
        for (rank, name), rest in sorted(self._partial.items()):
            self._file(name).write(f"{self.tag(rank, name)}{rest}\n")
            self._file(name).flush()
        self._partial.clear()


@dataclass
class RunResult:
    """What a finished :meth:`Pool.run` returns.

    ``ranks``: the ranks it ran on, in order; ``stdout``/``stderr``: full captured text
    per rank; ``results``: per rank, the ``text/plain`` form of the cell's last
    expression value (``None`` when the cell ended with a statement);
    ``result_data``: the full MIME bundle of that value (``{}`` when none);
    ``displays``: per rank, the ``display_data`` contents (``{"data": ..., "metadata":
    ...}``) the code published, e.g. figures; ``elapsed``: seconds from submission to
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
        printer = TaggedPrinter(stdout=file, stderr=file)
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
        result.stdout[rank] = metadata["stdout"]
        result.stderr[rank] = metadata["stderr"]
        execute_result = metadata.get("execute_result") or {}
        result.results[rank] = plain_result(execute_result)
        result.result_data[rank] = dict(execute_result.get("data") or {})
        result.displays[rank] = [
            {"data": out.get("data", {}), "metadata": out.get("metadata", {})}
            for out in metadata.get("outputs", [])
        ]
    return result
