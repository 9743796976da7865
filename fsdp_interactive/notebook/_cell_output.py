"""Per-rank output of a ``%%fsdp`` cell: collecting it and showing it (notebook side).

Default display: the lowest targeted rank's output (stdout, rich displays, last value)
plus every rank's stderr, with identical texts shown once for all ranks that produced
them.  ``group_outputs`` ("rank", "type" or "order", as ipyparallel's ``%%px``) shows
every rank.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
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


class _RetainingMetadata(defaultdict):
    """ipyparallel's per-request metadata dict that keeps what the client drops.

    ipyparallel pops a request's metadata (stdout, stderr, display outputs, result) from
    ``client.metadata`` as soon as that request's output is complete; a later lookup by
    msg_id then finds a fresh, empty record.  While installed, popped records stay
    readable under their msg_id, so output read after completion is still there.
    """

    def __init__(self, default_factory: Any, retained: dict[str, Any]):
        super().__init__(default_factory)
        self.retained = retained

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self.retained[key] = super().__getitem__(key)
        return super().pop(key, *default)

    def __missing__(self, key: Any) -> Any:
        if key in self.retained:
            return self.retained[key]
        return super().__missing__(key)


@contextlib.contextmanager
def retained_metadata(pool: Any) -> Iterator[None]:
    """Keep every request's output readable for the duration of one cell.

    The pool reads a run's output from the ipyparallel client's metadata by msg_id, which
    races with the client dropping it once complete; this keeps the records for the cell
    and restores the client's own dict afterwards (records of finished requests dropped,
    as the client intends).
    """
    client = getattr(pool, "_client", None)
    if client is None:
        yield
        return
    original = client.metadata
    keeper = _RetainingMetadata(original.default_factory, {})
    keeper.update(original)
    client.metadata = keeper
    try:
        yield
    finally:
        original.clear()
        original.update(dict(keeper))
        client.metadata = original


def message_count(pool: Any) -> int:
    """How many requests the pool's client has sent so far (marks the start of a run)."""
    client = getattr(pool, "_client", None)
    return len(client.history) if client is not None else 0


def collect_outputs(
    pool: Any, since: int, ranks: list[int], output_wait: float = 5.0
) -> dict[int, RankOutput]:
    """Outputs of the requests sent after ``since``, by rank (inside ``retained_metadata``).

    The pool's ``RunResult`` carries text output only, so rich outputs (display_data,
    execute_result bundles) are read from the ipyparallel client's per-request metadata.
    Returns what it could read; empty entries when the client is not reachable.
    """
    outputs = {rank: RankOutput(rank) for rank in ranks}
    client = getattr(pool, "_client", None)
    if client is None:
        return outputs
    rank_of_engine = {r.engine_id: r.rank for r in pool.topology}
    msg_ids = list(client.history)[since:]
    keeper = client.metadata
    if isinstance(keeper, _RetainingMetadata):
        # a record is dropped (and so retained) once its output is complete
        deadline = time.monotonic() + output_wait
        while time.monotonic() < deadline and not all(m in keeper.retained for m in msg_ids):
            time.sleep(0.02)
    for msg_id in msg_ids:
        metadata = client.metadata[msg_id]
        rank = rank_of_engine.get(metadata.get("engine_id"))
        if rank not in outputs:
            continue
        out = outputs[rank]
        out.stdout += metadata.get("stdout") or ""
        out.stderr += metadata.get("stderr") or ""
        out.displays.extend(metadata.get("outputs") or [])
        if metadata.get("execute_result"):
            out.result = metadata["execute_result"]
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
    """``on_output`` for ``Pool.run``: prints what the chosen display shows, as it arrives.

    Default: the lowest targeted rank's stdout untagged, every rank's stderr tagged.  With a
    grouping: every rank's lines tagged ``[rank N]``.
    """

    def __init__(self, first_rank: int, all_ranks: bool):
        from fsdp_interactive.pool import TaggedPrinter

        self.first_rank = first_rank
        self.all_ranks = all_ranks
        self._tagged = TaggedPrinter()

    def __call__(self, rank: int, name: str, text: str) -> None:
        if name == "stdout" and not self.all_ranks:
            if rank == self.first_rank:
                sys.stdout.write(text)
                sys.stdout.flush()
            return
        self._tagged(rank, name, text)

    def flush(self) -> None:
        self._tagged.flush()
        sys.stdout.flush()
