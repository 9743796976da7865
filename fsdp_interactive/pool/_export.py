"""``Pool.export``: a notebook session written out as a standalone torchrun script (and an
sbatch file) that builds the same state on its ranks, bit for bit.

The journal knows which calls built the ranks' state, in which order, with which random
generators, which values the notebook pushed and which scripts it ran. An export writes:

* ``PATH`` (a Python script): first the pool's group and namespace
  (:func:`~.rank._job.join`: backend, device, intra-op threads; ``rank``, ``world_size``,
  ``local_rank``, ``device``), then every part in the order it ran, at the script's top
  level (:mod:`._export_cells`), each cell starting from the generators its original
  started with where they differ from what the part before left;
* ``PATH`` with ``.values.json`` for ``.py``: the pushed values, the generator states and
  the scripts' sources, a private file (mode 0600) that the script reads only after
  checking its SHA-256 (written into the script), as JSON: no pickle (a pushed tensor
  inside is read with ``torch.load(weights_only=True)``; :func:`~.rank._job.load_values`);
* with ``sbatch``, ``PATH`` with ``.sbatch``: ``srun torchrun`` on the pool's hosts as
  nodes (:mod:`._export_launch`).

**What is exported.** By default the calls of the pool's current group that succeeded
(with those a recovery replayed to begin it), in order: running the script on the pool's
world size gives the parameters and optimizer state the notebook's ranks hold now. With
``from_snapshot`` (or ``from_checkpoint``, a folder a snapshot was persisted to) the
script builds what the snapshot restores into (the recovery's slice, :mod:`._slice`),
loads the snapshot (persisted beside the script) and then runs the *training cells*:
those named in ``train`` (cell numbers) or marked ``%%fsdp --export train``, by default
the calls that ran after the snapshot: its ranks then continue as the notebook's did. A
group that a recovery began is exported that way from the snapshot it recovered to.
Without a snapshot, cells named in ``train`` stay where they ran and are labelled so.

**What it refuses.** Any part it cannot carry (:mod:`._export_cells`; a change made
through a panel, outside any cell) is listed by cell with its reason; the export then
writes nothing (:class:`ExportRefused`), and ``dry_run`` shows the same list with the
plan. A call that failed never built state and is not exported (the plan says so).

Faults: the journal lives in the kernel; the pool must be running to tell its ranks'
threads and to persist a snapshot (it refuses otherwise, saying to recover first).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive import _private_files
from fsdp_interactive.pool._export_cells import (
    Names,
    Piece,
    carry_entry,
    carry_push,
    script_sources,
)
from fsdp_interactive.pool._export_launch import Layout, command_line, layout, sbatch_text
from fsdp_interactive.pool._journal import JournalEntry, Push
from fsdp_interactive.pool._script_record import replay_refusal
from fsdp_interactive.pool._slice import slice_for
from fsdp_interactive.pool.errors import Advised, PoolError, Step
from fsdp_interactive.pool.rank import _job

#: A :class:`~._pool.Pool` (not imported: the pool imports this module).
Pool = Any

DRY_RUN = Step(
    "see the whole plan with {}", "pool.export(path, dry_run=True)", "%fsdp export PATH --dry-run"
)
RECOVER_FIRST = Step("bring the ranks back with {}", "pool.recover()", "%fsdp recover")


class ExportRefused(Advised, PoolError):
    """The session cannot be exported as asked; ``plan`` (when there is one) lists every
    part with what it is, and each part that cannot be carried with its reason. Nothing
    was written."""

    def __init__(self, message: str, plan: ExportPlan | None = None, *steps: Step):
        self.plan = plan
        self._head = message
        self.advice = steps
        super().__init__(self._compose(False))


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes (or would: ``written`` False), part by part.

    ``pieces``: every part of the script in order (:class:`~._export_cells.Piece`);
    ``skipped``: the journal's calls of the group that are not parts, with why;
    ``restore``: the snapshot or folder the script loads (``None``: none); ``layout``:
    the job's nodes and ranks; ``world_size``: the pool's; ``command``: the torchrun line;
    ``notes``: what else the user should know (another world size, generators lost)."""

    script: str
    values: str
    sbatch: str | None
    pieces: tuple[Piece, ...]
    skipped: tuple[str, ...]
    restore: str | None
    layout: Layout
    world_size: int
    command: str
    notes: tuple[str, ...] = ()
    written: bool = False
    seconds: float = 0.0

    @property
    def refused(self) -> tuple[Piece, ...]:
        """The parts that cannot be carried, each with its reason."""
        return tuple(piece for piece in self.pieces if not piece.carried)

    def lines(self) -> list[str]:
        """The plan as the magic prints it: every part with what it is (or why it cannot be
        carried), what is not exported, the files, how to run them, notes."""
        verb = "exported" if self.written else "would export"
        source = f"from {self.restore}" if self.restore else "the notebook's current state"
        lines = [f"{verb} {self.script} ({source}; {self.world_size} ranks in the notebook)"]
        for piece in self.pieces:
            mark = "  " if piece.carried else "  CANNOT CARRY "
            lines.append(f"{mark}{piece.label}: {piece.why}")
        lines += [f"  not exported: {line}" for line in self.skipped]
        files = [self.script, self.values] + ([self.sbatch] if self.sbatch else [])
        lines.append(("files: " if self.written else "files it would write: ") + ", ".join(files))
        lines.append(f"run it: {self.command}")
        if self.sbatch:
            lines.append(f"or as a batch job: sbatch {self.sbatch}")
        lines += [f"note: {note}" for note in self.notes]
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass
class _Parts:
    """The entries and pushes the script is made of, by section."""

    build: list[JournalEntry | Push] = field(default_factory=list)
    train: list[JournalEntry | Push] = field(default_factory=list)
    refused: list[Piece] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    restore_label: str | None = None
    restore_folder: str | None = None
    restore_snapshot: str | None = None
    restored_names: set[str] = field(default_factory=set)
    #: Entries named in ``train`` (cell numbers given): labelled training cells.
    named: set[int] = field(default_factory=set)


def export(
    pool: Pool,
    path: str | os.PathLike[str],
    *,
    sbatch: bool = False,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    from_snapshot: str | None = None,
    from_checkpoint: str | os.PathLike[str] | None = None,
    train: Sequence[int] = (),
    dry_run: bool = False,
) -> ExportPlan:
    """``Pool.export`` (see the pool's method and the module's docstring)."""
    began = time.perf_counter()
    script = _script_path(path)
    if from_snapshot is not None and from_checkpoint is not None:
        raise ValueError("give from_snapshot or from_checkpoint, not both")
    cells = _cell_numbers(train)
    if not pool.running:
        raise ExportRefused(
            f"the pool is {pool.state}: an export asks the ranks for their threads and snapshots",
            None,
            RECOVER_FIRST,
        )
    plan_layout = layout(pool.topology, nodes, gpus_per_node)
    parts = _parts(pool, from_snapshot, from_checkpoint, cells, script)
    pieces, values, notes = _pieces(pool, parts)
    stem = os.path.splitext(script)[0]
    values_path = stem + ".values.json"
    sbatch_path = stem + ".sbatch" if sbatch else None
    first_host = pool.topology[0].address if pool.topology else None
    if plan_layout.world_size != pool.world_size:
        notes.append(
            f"the job has {plan_layout.world_size} ranks, the notebook {pool.world_size}: "
            "what it computes is not the notebook's state (the same only at the same world size)"
        )
    plan = ExportPlan(
        script=script,
        values=values_path,
        sbatch=sbatch_path,
        pieces=tuple(pieces),
        skipped=tuple(parts.skipped),
        restore=parts.restore_label,
        layout=plan_layout,
        world_size=pool.world_size,
        command=command_line(script, plan_layout, first_host),
        notes=tuple(notes),
    )
    if dry_run:
        return _timed(plan, began)
    if plan.refused:
        listed = "; ".join(f"{p.label}: {p.why}" for p in plan.refused)
        raise ExportRefused(
            f"{len(plan.refused)} part(s) of the session cannot be exported, nothing was "
            f"written: {listed}",
            plan,
            DRY_RUN,
        )
    _write(pool, plan, parts, values, pieces)
    return _timed(plan, began, written=True)


def _timed(plan: ExportPlan, began: float, *, written: bool = False) -> ExportPlan:
    from dataclasses import replace

    return replace(plan, written=written, seconds=time.perf_counter() - began)


# ---------------------------------------------------------------------------- what goes in


def _parts(
    pool: Pool,
    from_snapshot: str | None,
    from_checkpoint: str | os.PathLike[str] | None,
    cells: list[int],
    script: str,
) -> _Parts:
    journal = pool.journal
    epoch = journal.epoch
    lineage = journal.replay_for(None)
    parts = _Parts()
    if from_snapshot is None and from_checkpoint is None and epoch.snapshot is not None:
        # a recovery began this group: its state is the snapshot's, then this epoch's calls
        if os.sep in epoch.snapshot:
            from_checkpoint = epoch.snapshot
        else:
            from_snapshot = epoch.snapshot
    cut: int | None = None
    if from_snapshot is not None:
        snapshot = pool._snapshot_book.get(str(from_snapshot))
        if snapshot is None:
            known = ", ".join(s.id for s in pool.snapshots()) or "none"
            raise ExportRefused(f"no snapshot {from_snapshot!r} (known snapshots: {known})")
        sliced = slice_for(journal.replay_for(snapshot.call), snapshot.names)
        taken_in = journal.entry(snapshot.call) if snapshot.call is not None else None
        why = replay_refusal(sliced.replay, taken_in, None)
        if why is not None:
            raise ExportRefused(f"cannot export from the {snapshot.describe()}: {why}")
        build = list(sliced.replay)
        cut = snapshot.call if snapshot.call is not None else _last_id(journal.entries)
        parts.restore_label = f"the {snapshot.describe()}"
        parts.restore_snapshot = snapshot.id
        parts.restore_folder = f"{os.path.splitext(script)[0]}.{snapshot.id}"
        parts.restored_names = _roots(snapshot.names)
        parts.skipped += [
            f"{part.entry.label} ({part.why}; the snapshot holds its effect)"
            for part in sliced.parts
            if not part.replay
        ]
    elif from_checkpoint is not None:
        folder_path = os.path.abspath(os.fspath(from_checkpoint))
        names = _folder_names(folder_path)
        sliced = slice_for(lineage, names)
        build = list(sliced.replay)
        cut = _last_id(journal.entries)
        parts.restore_label = f"the checkpoint {folder_path}"
        parts.restore_folder = folder_path
        parts.restored_names = _roots(names)
        parts.skipped += [
            f"{part.entry.label} ({part.why}; the checkpoint holds its effect)"
            for part in sliced.parts
            if not part.replay
        ]
    else:
        build = list(lineage)
    succeeded = [e for e in journal.entries if e.outcome == "ok"]
    known = {e.cell: e for e in [*succeeded, *lineage] if e.cell is not None}
    for number in cells:
        if number not in known:
            parts.refused.append(
                Piece(
                    f"--train {number}",
                    "",
                    f"no cell In[{number}] among the calls that succeeded in this group",
                    False,
                )
            )
    named = {known[n].id for n in cells if n in known}
    parts.named = named
    if cut is None:
        train: list[JournalEntry] = []
    else:
        marked = [e for e in succeeded if e.id in named or "train" in e.marks]
        if not marked and from_snapshot is not None:
            marked = _continuation(journal, str(from_snapshot), cut)
        train = [e for e in marked if e not in build]
    parts.build = _with_pushes(build, journal.pushes, _epochs(build, epoch.number), None, cut)
    if train:
        parts.train = _with_pushes(
            train, journal.pushes, {epoch.number}, cut, max(e.id for e in train)
        )
    else:
        parts.train = []
    for change in journal.outside:
        if change.epoch == epoch.number and (cut is None or change.after >= cut):
            after = journal.entry(change.after)
            where = f"after {after.label}" if after is not None else "before any call"
            parts.refused.append(
                Piece(
                    f"a change {where}",
                    "",
                    f"{change.what}: made outside any cell (a panel), so no script can do it again",
                    False,
                )
            )
    exported = {id(e) for e in [*parts.build, *parts.train]}
    for entry in journal.entries:
        if entry.epoch != epoch.number or id(entry) in exported:
            continue
        if entry.outcome != "ok":
            parts.skipped.append(f"{entry.label} ({entry.outcome}: it built nothing to keep)")
        elif cut is not None and entry.id <= cut and entry not in build:
            continue  # said by the slice above
        elif cut is not None:
            parts.skipped.append(f"{entry.label} (not a training cell: not named in --train)")
    return parts


def _continuation(journal: Any, snapshot_id: str, call: int) -> list[JournalEntry]:
    """The calls that continued from the snapshot ``snapshot_id`` taken during entry
    ``call``: those of the group a recovery began from it, else those after it in its
    own group."""
    if journal.epoch.snapshot == snapshot_id:
        number = journal.epoch.number
    else:
        taken_in = journal.entry(call)
        number = taken_in.epoch if taken_in is not None else journal.epoch.number
    return [e for e in journal.entries if e.epoch == number and e.outcome == "ok" and e.id > call]


def _epochs(entries: Sequence[JournalEntry], current: int) -> set[int]:
    return {e.epoch for e in entries} | {current}


def _with_pushes(
    entries: Sequence[JournalEntry],
    pushes: Sequence[Push],
    epoch_numbers: set[int],
    after: int | None,
    before: int | None,
) -> list[JournalEntry | Push]:
    """``entries`` with the pushes made among them (in the given epochs, after entry id
    ``after`` and before ``before``), in the order they happened."""
    chosen = [
        push
        for push in pushes
        if push.epoch in epoch_numbers
        and (after is None or push.after >= after)
        and (before is None or push.after < before)
    ]
    items: list[tuple[tuple[int, int], JournalEntry | Push]] = [((e.id, 0), e) for e in entries]
    items += [((push.after, 1), push) for push in chosen]
    return [item for _, item in sorted(items, key=lambda pair: pair[0])]


def _pieces(pool: Pool, parts: _Parts) -> tuple[list[Piece], dict[str, Any], list[str]]:
    """Every part's :class:`Piece` in order (generator lines included), the values file's
    content, and notes."""
    journal = pool.journal
    names = Names()
    pieces: list[Piece] = list(parts.refused)
    values: dict[str, Any] = {"pushes": {}, "generators": {}, "scripts": {}}
    notes: list[str] = []
    previous_end: dict[int, str | None] = {}
    exported: dict[int, JournalEntry] = {}
    pushes = 0

    def add(items: Sequence[JournalEntry | Push]) -> None:
        nonlocal pushes
        for item in items:
            if isinstance(item, Push):
                pushes += 1
                key = str(pushes)
                piece, pushed = carry_push(item, f"push {', '.join(item.values)}", names, key)
                if pushed:
                    values["pushes"][key] = pushed
                pieces.append(piece)
                continue
            piece = carry_entry(item, names)
            if piece.carried and item.id in parts.named and piece.why == "cell":
                piece = Piece(piece.label, piece.code, "training cell")
            if piece.carried:
                exported[item.id] = item
                piece = _with_generators(piece, item, journal, previous_end, values, pool)
            pieces.append(piece)

    add(parts.build)
    if parts.restore_folder is not None:
        missing = names.missing(parts.restored_names)
        relative = os.path.basename(parts.restore_folder)
        where = relative if parts.restore_snapshot else parts.restore_folder
        code = f"_export.restore(__file__, {where!r}, globals())"
        if missing:
            pieces.append(
                Piece(
                    f"restore {parts.restore_label}",
                    "",
                    f"it loads into {', '.join(missing)}, which nothing exported before defines",
                    False,
                )
            )
        else:
            pieces.append(
                Piece(f"restore {parts.restore_label}", code, "loads it into the objects")
            )
        previous_end.clear()  # the snapshot restored every rank's generators
    add(parts.train)
    values["scripts"] = script_sources(exported)
    lacking = sorted(
        entry.label
        for entry in exported.values()
        if len(journal.generators.ranks_of(entry.id)) < pool.world_size
        and entry.replay is not False
    )
    if lacking:
        notes.append(
            f"{', '.join(lacking)}: some ranks' generator states were lost with a rank "
            "(those cells start from the generators as they are)"
        )
    return pieces, values, notes


def _with_generators(
    piece: Piece,
    entry: JournalEntry,
    journal: Any,
    previous_end: dict[int, str | None],
    values: dict[str, Any],
    pool: Pool,
) -> Piece:
    """``piece`` preceded by setting the generators its original started with, where some
    rank's differ from what the part before left; those states go in ``values``."""
    ranks = sorted(journal.generators.ranks_of(entry.id))
    changed = False
    for rank in ranks:
        start, end = journal.generators.digests(entry.id, rank)
        if start is not None and previous_end.get(rank) != start:
            changed = True
        previous_end[rank] = end
    if not changed:
        return piece
    key = str(entry.id)
    states = {}
    for rank in ranks:
        start, _ = journal.generators.of(entry.id, rank)
        if start is not None:
            states[rank] = start
    values["generators"][key] = states
    code = f"_export.set_generators(_values, {key!r})\n{piece.code}"
    return Piece(piece.label, code, piece.why, piece.carried)


# ---------------------------------------------------------------------------- writing


def _write(
    pool: Pool, plan: ExportPlan, parts: _Parts, values: dict[str, Any], pieces: list[Piece]
) -> None:
    if parts.restore_snapshot is not None and parts.restore_folder is not None:
        _persist(pool, parts.restore_snapshot, parts.restore_folder)
    digest = _job.write_values(plan.values, values)
    threads = pool._call(_job.intra_op_threads, (), {}, stream=False)[0]
    backend = pool.topology[0].backend
    text = _script_text(plan, pieces, backend, int(threads), digest)
    _job.replace_private_file(plan.script, text.encode("utf-8"))
    if plan.sbatch is not None:
        name = os.path.splitext(os.path.basename(plan.script))[0]
        _job.replace_private_file(plan.sbatch, sbatch_text(plan.script, plan.layout, name).encode())


def _persist(pool: Pool, snapshot_id: str, folder: str) -> None:
    """The snapshot written to ``folder`` beside the script (kept when it holds it already)."""
    from fsdp_interactive.checkpoint import persist_snapshot

    record = os.path.join(folder, "snapshot.json")
    if os.path.isfile(record):
        try:
            held = json.loads(_private_files.read_regular(record).decode("utf-8")).get("id")
        except (OSError, ValueError):
            held = None
        if held == snapshot_id:
            return
        raise ExportRefused(
            f"{folder} holds another snapshot ({held}); remove it or export to another path"
        )
    pool._call(persist_snapshot, (snapshot_id, folder), {}, stream=False)


def _script_text(
    plan: ExportPlan, pieces: list[Piece], backend: str, threads: int, digest: str
) -> str:
    labels = ", ".join(p.label for p in pieces)
    head = [
        f'"""A notebook session of fsdp_interactive {_version()}, exported '
        f"{time.strftime('%Y-%m-%d %H:%M')}: {labels}.",
        "",
        f"Run on {plan.world_size} ranks (the notebook's) for its state, bit for bit:",
        "",
        f"    {plan.command}",
        "",
        f"{os.path.basename(plan.values)} beside it holds the values the notebook pushed, the",
        "random generators each cell started with and the sources of the scripts it ran; it is",
        "read only if its SHA-256 is the one below, and without running any code.",
        '"""',
        "",
        "import fsdp_interactive",
        "import torch",
        "import torch.distributed as dist",
        "from fsdp_interactive import job as _export",
        "",
        "# The pool's group and namespace; its ranks ran with "
        f"{threads} intra-op thread{'s' if threads != 1 else ''}.",
        f"rank, world_size, local_rank, device = _export.join({backend!r}, threads={threads})",
        f"_values = _export.load_values(__file__, {os.path.basename(plan.values)!r}, {digest!r})",
        "",
    ]
    body = []
    for piece in pieces:
        body.append(f"# {'-' * 4} {piece.label}: {piece.why} ".ljust(88, "-"))
        body.append(piece.code)
        body.append("")
    return "\n".join([*head, *body, "_export.end()", ""])


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("fsdp-interactive")
    except metadata.PackageNotFoundError:
        return "(not installed)"


# ---------------------------------------------------------------------------- checks


def _script_path(path: Any) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be the path of the script to write, got {path!r}")
    script = os.path.abspath(os.fspath(path))
    if not script.endswith(".py"):
        raise ValueError(f"path must name a Python script (ending in .py), got {os.fspath(path)!r}")
    if not os.path.isdir(os.path.dirname(script)):
        raise ValueError(f"the folder of {script} does not exist")
    return script


def _cell_numbers(train: Any) -> list[int]:
    if isinstance(train, int) and not isinstance(train, bool):
        train = [train]
    if isinstance(train, str) or not isinstance(train, Sequence):
        raise TypeError(f"train must be a list of cell numbers, got {train!r}")
    bad = [c for c in train if isinstance(c, bool) or not isinstance(c, int) or c < 0]
    if bad:
        raise ValueError(f"train must be cell numbers (the notebook's In[N]), got {bad[0]!r}")
    return list(train)


def _folder_names(folder: str) -> dict[str, Any]:
    record = os.path.join(folder, "snapshot.json")
    if not os.path.isdir(folder):
        raise ExportRefused(f"no checkpoint folder {folder!r}")
    try:
        data = json.loads(_private_files.read_regular(record).decode("utf-8"))
    except (OSError, ValueError):
        raise ExportRefused(
            f"{folder} is not a persisted snapshot (no readable {record}): a checkpoint of "
            "checkpoint.save names no variables to load into; persist a snapshot with "
            "%fsdp snapshot --persist DIR (or fsdp_interactive.checkpoint.persist_snapshot)"
        ) from None
    names = data.get("names") if isinstance(data, dict) else None
    if not isinstance(names, dict):
        raise ExportRefused(f"the snapshot record {record} names no objects")
    return names


def _roots(names: Any) -> set[str]:
    if not isinstance(names, dict):
        return set()
    paths = [names.get("model"), names.get("optimizer"), *(names.get("stateful") or {}).values()]
    return {str(p).split(".", 1)[0] for p in paths if isinstance(p, str)}


def _last_id(entries: Sequence[JournalEntry]) -> int:
    return entries[-1].id if entries else 0
