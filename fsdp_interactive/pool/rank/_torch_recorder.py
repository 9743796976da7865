"""Rank side: torch's flight recorder, turned on before the group forms and read on demand.

The one place the pool touches torch's private flight-recorder names
(``torch._C._distributed_c10d._dump_fr_trace``); everything else sees
:class:`pool.common._collectives.RecorderDump`.

Checked on torch 2.13.0 (CPU build) and 2.9.1 (PyPI's CUDA build, run on CPU), gloo,
with the same results: ``_dump_fr_trace(includeCollectives,
includeStackTraces, onlyActive)`` returns a pickled dict with ``entries`` (one per
collective: ``profiling_name`` such as ``"gloo:all_reduce"``, ``collective_seq_id``,
``process_group`` = ``(id, description)``, input/output sizes and dtypes, ``state``,
``retired``, ``is_p2p``, ``frames`` of the issuing Python stack, innermost first) and
``pg_status`` (per group: ``last_enqueued_collective``, ``last_completed_collective``).
Gloo entries keep ``state == "scheduled"`` after they complete; ``retired`` turns true
when the work completes, and ``pg_status`` counts completions. The ring buffer holds
``TORCH_FR_BUFFER_SIZE`` entries (2000 when unset), read once per process when the
recorder is first used, i.e. when the first process group is created: the size must be
in the environment before ``init_process_group``.

Other torch versions of the package's range (2.9 .. 2.14) are not assumed to behave the
same: :func:`check` looks, right after the group's first collective, whether it was
recorded, and says why not when it was not (no dump function in this torch, or no
recording of this backend). The pool then reports that note instead of a diagnosis.
"""

from __future__ import annotations

import linecache
import os
import pickle
import re
import time
from collections.abc import Callable
from typing import Any

from fsdp_interactive.pool.common._collectives import CollectiveRecord, RecorderDump
from fsdp_interactive.pool.common._stacks import Frame
from fsdp_interactive.pool.rank._thread_stacks import CodeName

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
_LEGACY_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
_TORCH_PATH = re.compile(r"[/\\]torch[/\\]")

_note: str | None = "the flight recorder was not checked on this rank yet"


def checked() -> bool:
    """Whether :func:`check` found the recorder recording (until then :func:`dump` returns
    only a note)."""
    return _note is None


def recorded_any() -> bool:
    """Whether any recorder of this torch holds an entry (a group issued a collective)."""
    return any(raw.get("entries") for _, raw in _raw_dumps(stack_traces=False))


def configure(buffer_size: int | None) -> None:
    """Ask for a ring buffer of ``buffer_size`` entries (0: off) before the group forms.

    ``None`` keeps what the environment says. A size set in the environment by the user
    (``TORCH_FR_BUFFER_SIZE``) is kept unless ``buffer_size`` is given explicitly.
    """
    if buffer_size is not None:
        os.environ[BUFFER_ENV] = str(int(buffer_size))


def buffer_size() -> int:
    """The ring buffer size this process asked for (torch's default 2000 when unset)."""
    value = os.environ.get(BUFFER_ENV) or os.environ.get(_LEGACY_BUFFER_ENV) or "2000"
    try:
        return int(value)
    except ValueError:
        return 2000


def check(backend: str) -> str | None:
    """After the group's first collective: ``None`` when it was recorded, else why not.

    ``backend``: the group's backend as ``torch.distributed`` names it (``"nccl"``,
    ``"gloo"``, ``"cpu:gloo,cuda:nccl"``). The answer is kept for :func:`dump`.
    """
    global _note
    import torch

    recorders = dict(recorders_of_this_torch())
    missing = [name for name in recorders_for(backend) if name not in recorders]
    if buffer_size() <= 0:
        _note = f"the flight recorder is off ({BUFFER_ENV}=0; Pool(flight_recorder=N) turns it on)"
    elif missing:
        _note = (
            f"torch {torch.__version__} has no flight recorder dump for "
            f"{'/'.join(_BACKEND_OF_RECORDER[name] for name in missing)}"
        )
    elif not any(raw.get("entries") for _, raw in _raw_dumps(stack_traces=False)):
        _note = f"torch {torch.__version__} does not record {backend} collectives"
    else:
        _note = None
    return _note


#: Which backends record into each recorder (for notes).
_BACKEND_OF_RECORDER = {"nccl": "nccl", "generic": "gloo"}


def recorders_for(backend: str) -> list[str]:
    """The recorders a group of ``backend`` records into: ``"nccl"`` (NCCL's own) and/or
    ``"generic"`` (gloo and other CPU backends), e.g. both for ``"cpu:gloo,cuda:nccl"``."""
    names = {part.rpartition(":")[2].strip() for part in backend.split(",")}
    wanted = ["nccl"] if "nccl" in names else []
    if names - {"nccl"}:
        wanted.append("generic")
    return wanted


def recorders_of_this_torch() -> list[tuple[str, Callable[..., bytes]]]:
    """``(name, dump function)`` of every recorder this torch has, NCCL's first."""
    from fsdp_interactive._torch_compat import flight_recorder_dump, nccl_flight_recorder_dump

    found = [("nccl", nccl_flight_recorder_dump()), ("generic", flight_recorder_dump())]
    return [(name, function) for name, function in found if function is not None]


def _raw_dumps(stack_traces: bool) -> list[tuple[str, dict[str, Any]]]:
    """Every recorder's unpickled dump, as ``(recorder name, dump)``."""
    return [
        (name, pickle.loads(function(True, stack_traces, False)))
        for name, function in recorders_of_this_torch()
    ]


def _group_of(entry: dict[str, Any]) -> str:
    return str([*(entry.get("process_group") or ()), "?"][0])


def merged(dumps: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One dump (``entries``, ``pg_status``) from several recorders' ``(name, dump)``.

    A group id that an earlier recorder already holds is filed as ``"<id>/<backend>"``
    (the backend from the entries' ``profiling_name``, else the recorder's name), so
    that two backends' sequence numbers of one group never mix.
    """
    entries: list[dict[str, Any]] = []
    status: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for name, raw in dumps:
        raw_entries = list(raw.get("entries") or [])
        raw_status = dict(raw.get("pg_status") or {})
        groups = {_group_of(e) for e in raw_entries} | {str(g) for g in raw_status}
        renamed: dict[str, str] = {}
        for group in sorted(groups):
            if owner.setdefault(group, name) != name:
                backends = {
                    str(e.get("profiling_name", "")).rpartition(":")[0]
                    for e in raw_entries
                    if _group_of(e) == group
                }
                label = next(iter(backends)) if len(backends) == 1 and "" not in backends else name
                renamed[group] = f"{group}/{label}"
        for entry in raw_entries:
            group = _group_of(entry)
            if group in renamed:
                rest = list(entry.get("process_group") or ())[1:]
                entry = {**entry, "process_group": (renamed[group], *rest)}
            entries.append(entry)
        for group, value in raw_status.items():
            status[renamed.get(str(group), str(group))] = value
    return {"entries": entries, "pg_status": status}


def dump(
    last: int | None = None, code_name: CodeName | None = None, issued_at: bool = False
) -> RecorderDump:
    """This rank's recorders, merged: the last ``last`` entries (all when ``None``).

    ``issued_at``: also say which line issued each collective, from the Python stacks
    the recorder keeps. torch symbolizes those stacks on the first such dump, which
    imports ``torch._inductor`` (measured on torch 2.13: about 1.4 s and 70 MB per
    process); without it a dump takes well under a millisecond.
    """
    if _note is not None:
        return RecorderDump(note=_note)
    raw = merged(_raw_dumps(stack_traces=issued_at))
    return records_of(raw, last, code_name)


def records_of(
    raw: dict[str, Any], last: int | None = None, code_name: CodeName | None = None
) -> RecorderDump:
    """A :class:`RecorderDump` of one (merged) raw dump; ``last``: keep the last entries."""
    entries = list(raw.get("entries", []))
    if last is not None:
        entries = entries[-last:]
    status = raw.get("pg_status", {}) or {}
    last_issued = {str(g): int(s.get("last_enqueued_collective", 0)) for g, s in status.items()}
    last_completed = {
        str(g): int(s.get("last_completed_collective", -1)) for g, s in status.items()
    }
    now_ns = time.time_ns()
    records = tuple(_record(entry, last_completed, code_name, now_ns) for entry in entries)
    return RecorderDump(records, last_issued, last_completed)


def _record(
    entry: dict[str, Any],
    last_completed: dict[str, int],
    code_name: CodeName | None,
    now_ns: int | None = None,
) -> CollectiveRecord:
    group, desc = [*(entry.get("process_group") or ()), "?", "?"][:2]
    group = str(group)
    backend, _, op = str(entry.get("profiling_name", "")).rpartition(":")
    seq = int(entry.get("collective_seq_id", 0))
    state = str(entry.get("state", ""))
    completed: bool | None = None
    if state == "completed" or entry.get("retired"):
        completed = True
    elif group in last_completed:
        completed = seq <= last_completed[group]
    created = entry.get("time_created_ns")
    pending_s = None
    if completed is False and isinstance(created, int) and created > 0 and now_ns is not None:
        pending_s = max(0.0, (now_ns - created) / 1e9)
    return CollectiveRecord(
        group=group,
        group_desc=str(desc),
        seq=seq,
        op=op or "?",
        backend=backend,
        input_sizes=tuple(tuple(int(d) for d in size) for size in entry.get("input_sizes", [])),
        output_sizes=tuple(tuple(int(d) for d in size) for size in entry.get("output_sizes", [])),
        input_dtypes=tuple(str(d) for d in entry.get("input_dtypes", [])),
        output_dtypes=tuple(str(d) for d in entry.get("output_dtypes", [])),
        completed=completed,
        state=state,
        issued_at=_issuer(entry.get("frames") or [], code_name),
        p2p=bool(entry.get("is_p2p", False)),
        pending_s=pending_s,
    )


def _issuer(frames: list[dict[str, Any]], code_name: CodeName | None) -> Frame | None:
    """The notebook cell line that issued a collective, else the innermost frame outside torch."""
    outside = []
    for raw in frames:  # innermost first
        filename = str(raw.get("filename", ""))
        if _TORCH_PATH.search(filename):
            continue
        line = int(raw.get("line", 0))
        cell = code_name(filename) if code_name is not None else None
        source = linecache.getline(filename, line).strip() or None
        outside.append(Frame(filename, line, str(raw.get("name", "?")), source, cell))
    cells = [frame for frame in outside if frame.cell]
    if cells:
        return cells[0]
    return outside[0] if outside else None
