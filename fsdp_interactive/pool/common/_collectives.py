"""The ranks' recent collectives, from torch's flight recorder: records, diagnosis, table.

Every rank keeps a small ring buffer of the collectives it issued (torch's flight
recorder, read on the rank by :mod:`pool.rank._torch_recorder`). Collectives of one process
group are numbered in issue order on every rank of the group, so comparing those
numbers across ranks says where ranks disagree: a rank that waits in ``barrier #12``
while another never issued ``#12``, or two ranks that issued different collectives as
``#57``. The recorder's per-entry state is not used for that (gloo entries stay
"scheduled" after they complete); completion comes from the entry's ``retired`` flag and
the group's last completed number.

Plain data and text only: free of torch, IPython and ipyparallel, imported by the ranks
(which build the records) and by the kernel (which compares them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fsdp_interactive.pool.common._stacks import Frame, describe, in_distributed, location

DEFAULT_GROUP = "0"

#: Backends whose collectives are queued on a device stream: the call returns at once and
#: the collective completes (or never does) on the device.
STREAM_ORDERED_BACKENDS = frozenset({"nccl"})

#: Collectives whose tensors legitimately differ in size between ranks (a root gathers or
#: scatters; all-to-all splits unevenly): only the op and dtypes must agree.
_RAGGED_OPS = frozenset(
    {"gather", "scatter", "all_to_all", "alltoall", "alltoall_base", "all_to_all_single"}
)


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective a rank issued.

    ``group``: the process group's id as the recorder numbers them (``"0"`` is the
    default group), ``group_desc`` its description; ``seq``: the collective's number in
    the group; ``op``: ``"all_reduce"``, ``"barrier"``, ...; ``completed``: whether it
    finished on this rank (``None``: unknown); ``issued_at``: the innermost frame outside
    torch that issued it; ``pending_s``: for one that has not completed, seconds since it
    was issued (when the recorder says when).
    """

    group: str
    group_desc: str
    seq: int
    op: str
    backend: str
    input_sizes: tuple[tuple[int, ...], ...] = ()
    output_sizes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()
    output_dtypes: tuple[str, ...] = ()
    completed: bool | None = None
    state: str = ""
    issued_at: Frame | None = None
    p2p: bool = False
    pending_s: float | None = None

    @property
    def stream_ordered(self) -> bool:
        """Whether the rank's Python thread returned from this collective at once and
        only the device waits for it (NCCL): a rank then blocks at its next
        synchronisation with the device (``.item()``, ``print(t)``,
        ``torch.cuda.synchronize()``), outside ``torch.distributed``."""
        return self.backend in STREAM_ORDERED_BACKENDS

    def signature(self) -> tuple[object, ...]:
        """What every rank of a group must agree on for the same ``seq``: the op, and the
        input sizes and dtypes unless the op's sizes differ by rank (gather, scatter,
        all-to-all); outputs are not compared (a gather's root alone has them)."""
        if self.op in _RAGGED_OPS:
            return (self.op, frozenset(self.input_dtypes + self.output_dtypes))
        return (self.op, self.input_sizes, self.input_dtypes)

    def shapes(self) -> str:
        """``Float 3x4`` style text of the inputs (outputs when there are no inputs)."""
        sizes = self.input_sizes or self.output_sizes
        dtypes = self.input_dtypes or self.output_dtypes
        if not sizes:
            return ""
        dtype = "/".join(dict.fromkeys(dtypes))
        return f"{dtype} {format_sizes(sizes)}".strip()


@dataclass(frozen=True)
class RecorderDump:
    """One rank's recorder: ``records`` oldest first; per group the number of the last
    collective issued and completed (``last_issued``, ``last_completed``); ``note`` says
    why there are no records when the recorder is off or unavailable."""

    records: tuple[CollectiveRecord, ...] = ()
    last_issued: Mapping[str, int] = field(default_factory=dict)
    last_completed: Mapping[str, int] = field(default_factory=dict)
    note: str | None = None


def unfinished_on_device(dump: RecorderDump | None) -> list[CollectiveRecord]:
    """The stream-ordered (NCCL) collectives of ``dump`` that have not completed on the
    device, oldest first: what a rank that waits for its GPU waits behind."""
    if dump is None or dump.note:
        return []
    return [r for r in dump.records if r.stream_ordered and r.completed is False]


def waiting_behind(record: CollectiveRecord) -> str:
    """``nccl all_reduce #12, unfinished on the GPU for 34 s`` for one unfinished
    collective (``group 1 (desc): ...`` outside the default group)."""
    label = _group_label(record.group, record.group_desc)
    text = f"{label}{record.backend} {record.op} #{record.seq}, unfinished on the GPU"
    if record.pending_s is not None:
        text += f" for {record.pending_s:.0f} s"
    return text


def blocked_where(
    frames: Sequence[Frame], dump: RecorderDump | None, code: str | None = None
) -> str | None:
    """Where a rank that runs user code (``frames``, innermost first) is blocked in a
    collective, or ``None`` when it is not.

    Blocked: its stack is inside ``torch.distributed`` (a gloo collective, an NCCL
    ``barrier`` or ``wait``), or its NCCL recorder (``dump``) holds a collective that has
    not completed on the GPU while the rank runs code: NCCL calls return at once, so a
    rank waits behind such a collective at its next synchronisation with the GPU
    (``.item()``, ``print(t)``), a C++ call that a signal does not interrupt either.
    """
    if not frames:
        return None
    if in_distributed(frames) is not None:
        return describe(frames, code)
    behind = unfinished_on_device(dump)
    if not behind:
        return None
    return f"{describe(frames, code)}, behind {waiting_behind(behind[0])}"


def format_sizes(sizes: Sequence[Sequence[int]]) -> str:
    """``[[3, 4], [2]]`` -> ``"3x4, 2"``; a 0-d tensor is ``"scalar"``; none is ``"-"``."""
    if not sizes:
        return "-"
    return ", ".join("x".join(map(str, size)) or "scalar" for size in sizes)


def ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def collective_label(record: CollectiveRecord) -> str:
    """``barrier #12``; outside the default group ``group 1 (desc): all_reduce #3``."""
    return f"{_group_label(record.group, record.group_desc)}{record.op} #{record.seq}"


def _group_label(group: str, desc: str) -> str:
    return "" if group == DEFAULT_GROUP else f"group {group} ({desc}): "


def _by_seq(dump: RecorderDump, group: str) -> dict[int, CollectiveRecord]:
    return {r.seq: r for r in dump.records if r.group == group and not r.p2p}


def _last(dump: RecorderDump, group: str) -> int:
    seqs = [r.seq for r in dump.records if r.group == group and not r.p2p]
    return max([dump.last_issued.get(group, 0), *seqs])


def groups_of(dumps: Mapping[int, RecorderDump]) -> list[tuple[str, str]]:
    """``(group id, description)`` of every group any rank recorded, default group first."""
    found: dict[str, str] = {}
    for dump in dumps.values():
        for record in dump.records:
            found.setdefault(record.group, record.group_desc)
    return sorted(found.items(), key=lambda item: (item[0] != DEFAULT_GROUP, item[0]))


def diagnose(
    dumps: Mapping[int, RecorderDump],
    finished: Iterable[int] = (),
    where: Mapping[int, str] | None = None,
) -> list[str]:
    """One line per process group whose ranks disagree, plus one per unavailable recorder.

    ``finished``: ranks that completed the call being diagnosed; ``where``: one-line
    summaries of where the others are. Lines read like "rank 0 waits in barrier #12;
    rank 1 never issued #12 (it finished the cell after #11)" or "rank 0 all_gather #57
    vs rank 1 reduce_scatter #57". Nothing is said of groups whose ranks agree.
    """
    finished = set(finished)
    where = dict(where or {})
    lines = []
    notes: dict[str, list[int]] = {}
    for rank, dump in dumps.items():
        if dump.note:
            notes.setdefault(dump.note, []).append(rank)
    for group, desc in groups_of(dumps):
        if group == DEFAULT_GROUP:
            members = [r for r, d in dumps.items() if not d.note]
        else:
            members = [r for r, d in dumps.items() if _by_seq(d, group)]
        if len(members) < 2:
            continue
        label = _group_label(group, desc)
        mismatch = _first_mismatch(dumps, group, members)
        if mismatch:
            lines.append(label + mismatch)
        lag = _lag(dumps, group, members, finished, where)
        if lag:
            lines.append(label + lag)
    for note, ranks in notes.items():
        lines.append(f"collective trace unavailable on {ranks_text(ranks)}: {note}")
    return lines


def _first_mismatch(
    dumps: Mapping[int, RecorderDump], group: str, members: list[int]
) -> str | None:
    records = {rank: _by_seq(dumps[rank], group) for rank in members}
    shared = sorted(set.union(*(set(by_seq) for by_seq in records.values())))
    for seq in shared:
        present = {rank: by_seq[seq] for rank, by_seq in records.items() if seq in by_seq}
        if len(present) < 2:
            continue
        kinds: dict[tuple[object, ...], list[int]] = {}
        for rank, record in present.items():
            kinds.setdefault(record.signature(), []).append(rank)
        if len(kinds) == 1:
            continue
        same_op = len({present[ranks[0]].op for ranks in kinds.values()}) == 1
        parts = []
        for ranks in sorted(kinds.values()):
            record = present[ranks[0]]
            text = f"{ranks_text(ranks)} {record.op} #{seq}"
            if same_op and record.shapes():
                text += f" ({record.shapes()})"
            parts.append(text)
        return " vs ".join(parts)
    return None


def _lag(
    dumps: Mapping[int, RecorderDump],
    group: str,
    members: list[int],
    finished: set[int],
    where: Mapping[int, str],
) -> str | None:
    last = {rank: _last(dumps[rank], group) for rank in members}
    top = max(last.values())
    ahead = [rank for rank in members if last[rank] == top]
    behind = [rank for rank in members if last[rank] < top]
    if not behind:
        waiting = [
            rank
            for rank in ahead
            if (record := _by_seq(dumps[rank], group).get(top)) and record.completed is False
        ]
        if waiting and len(waiting) == len(ahead):
            op = _by_seq(dumps[waiting[0]], group)[top].op
            return f"every rank issued {op} #{top} and waits in it"
        return None
    ahead_parts: dict[str, list[int]] = {}
    for rank in ahead:
        record = _by_seq(dumps[rank], group).get(top)
        op = record.op if record else "a collective"
        verb = "issued" if record is not None and record.completed else "waits in"
        ahead_parts.setdefault(f"{verb} {op} #{top}", []).append(rank)
    text = "; ".join(
        f"{ranks_text(ranks)} {_plural(what, len(ranks))}" for what, ranks in ahead_parts.items()
    )
    behind_parts: dict[tuple[int, str], list[int]] = {}
    for rank in behind:
        if rank in finished:
            reason = f"finished the cell after #{last[rank]}"
        elif rank in where:
            reason = f"last issued #{last[rank]} and is now {where[rank]}"
        else:
            reason = f"last issued #{last[rank]}"
        behind_parts.setdefault((last[rank], reason), []).append(rank)
    for (_, reason), ranks in sorted(behind_parts.items()):
        pronoun = "it" if len(ranks) == 1 else "they"
        if len(ranks) > 1:
            reason = reason.replace(" and is now ", " and are now ")
        text += f"; {ranks_text(ranks)} never issued #{top} ({pronoun} {reason})"
    return text


def _plural(what: str, count: int) -> str:
    """``"waits in barrier #3"`` for one rank, ``"wait in barrier #3"`` for several."""
    if count > 1 and what.startswith("waits "):
        return "wait " + what[len("waits ") :]
    return what


TABLE_HEADERS = ("group", "#", "ranks", "op", "in", "out", "dtype", "state", "issued at")
_NO_ISSUER_HEADERS = TABLE_HEADERS[:-1]


def table_rows(dumps: Mapping[int, RecorderDump], last: int = 20) -> list[tuple[str, ...]]:
    """Rows of every rank's last ``last`` collectives per group, merged across ranks that
    recorded the same thing; ranks that did not issue a number others issued get a
    ``(not issued)`` row."""
    rows = []
    for group, _desc in groups_of(dumps):
        per_rank = {rank: _by_seq(dump, group) for rank, dump in dumps.items() if not dump.note}
        per_rank = {rank: by_seq for rank, by_seq in per_rank.items() if by_seq}
        if not per_rank:
            continue
        seqs = sorted(set().union(*per_rank.values()))[-last:]
        for seq in seqs:
            kinds: dict[tuple[str, ...], list[int]] = {}
            for rank, by_seq in per_rank.items():
                record = by_seq.get(seq)
                if record is None:
                    top = max(by_seq)
                    key: tuple[str, ...] = (
                        ("(not issued)", "", "", "", "", "")
                        if top < seq
                        else ("(not recorded)", "", "", "", "", "")
                    )
                else:
                    key = _row_cells(record)
                kinds.setdefault(key, []).append(rank)
            for key, ranks in sorted(kinds.items(), key=lambda item: item[1][0]):
                ranks_cell = "all" if len(ranks) == len(per_rank) else ",".join(map(str, ranks))
                rows.append((group, str(seq), ranks_cell, *key))
    return rows


def _row_cells(record: CollectiveRecord) -> tuple[str, ...]:
    dtypes = "/".join(dict.fromkeys(record.input_dtypes or record.output_dtypes)) or "-"
    if record.completed is True:
        state = "done"
    elif record.completed is False:
        state = "waiting"
    else:
        state = record.state or "-"
    issued = location(record.issued_at) if record.issued_at is not None else "-"
    return (
        record.op,
        format_sizes(record.input_sizes),
        format_sizes(record.output_sizes),
        dtypes,
        state,
        issued,
    )


def table_text(dumps: Mapping[int, RecorderDump], last: int = 20) -> str:
    """Every rank's last collectives as a text table (empty when nothing was recorded)."""
    rows = table_rows(dumps, last=last)
    if not rows:
        return ""
    headers: tuple[str, ...] = TABLE_HEADERS
    if all(row[-1] in ("-", "") for row in rows):  # recorded without the issuing stacks
        headers = _NO_ISSUER_HEADERS
        rows = [row[:-1] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


@dataclass(frozen=True)
class CollectiveTrace:
    """What :meth:`Pool.trace` returns: every rank's recorder (``dumps``), the lines where
    ranks disagree (``findings``) and the ``last`` entries per group shown by ``str()``."""

    dumps: dict[int, RecorderDump]
    findings: list[str]
    last: int = 20

    def table(self, last: int | None = None) -> str:
        """The trace as a text table: each rank's last ``last`` collectives per process group
        (default: the ``last`` the trace was asked with)."""
        return table_text(self.dumps, self.last if last is None else last)

    def groups(self) -> list[tuple[str, str]]:
        """``(group id, description)`` of every group any rank recorded, default group first."""
        return groups_of(self.dumps)

    def __str__(self) -> str:
        findings = self.findings or ["the ranks agree on every recorded collective"]
        table = self.table() or "(no collectives recorded)"
        return "\n".join([*findings, "", table])
