"""``Pool.recover``: back to the last snapshot after a fault, in seconds.

A recovery, in order (each phase timed in the :class:`RecoveryReport`):

1. **plan** (:func:`make_plan`): which snapshot (the newest the kernel heard of, one named
   by id) or disk checkpoint (a folder) to go back to, which journal entries rebuild the
   objects it restores into (the slice, :mod:`._slice`: each candidate entry's part and
   why), and on how many ranks (the same; the hosts that remain after a lost host;
   ``world=``). Nothing is touched when there is nothing to recover to, or when the checks
   of :mod:`._recovery_checks` refuse the input (they ask the ranks while they run).
   ``dry_run`` stops here.
2. **end**: what is left of the group goes (ranks blocked in a wedged collective are
   killed); the host's engine forkers and the snapshots in host memory stay. Each host's
   forker first starts hashing its copy of the planned snapshot in a child
   (:mod:`fsdp_interactive.checkpoint._format._prechecked`), with the CPU time that ending and
   starting the group leave idle; the restore then hashes only the files it did not record (a
   precheck that dies, or a file changed since, costs the restore's own check, no more).
3. **start**: a fresh group on the same placement (or the reduced one).
4. **find**: the new ranks list the snapshots their hosts hold; the newest is taken when
   no id was asked for (a notice lost with a dead rank does not hide a newer snapshot).
5. **replay** (:mod:`._replay`): the slice's entries run again in order, their output not
   shown, one line each, each with the random generators its original started and ended
   with, parameter initialization skipped where the snapshot overwrites it; snapshots are
   not taken while replaying (:func:`fsdp_interactive._notices.replaying`). A failing
   entry stops the recovery with its error and leaves a fresh, empty group.
6. **restore**: every rank loads the snapshot into the objects the replay recreated
   (model, optimizer, RNG, stateful objects), resharding to a new world size; a snapshot
   that is corrupt or incomplete on the remaining hosts is refused and the next older
   one the hosts hold is tried (with its own replay). An object the replay did not put
   back where the snapshot recorded it fails the recovery, naming it (never a success
   over a partial restore), and leaves a fresh, empty group.

The pool's journal then begins a new epoch based on what was replayed, so that a second
fault recovers the same way. Faults during a recovery: a rank that dies while replaying or
restoring fails the recovery with :class:`RecoveryError` (the snapshots stay in host
memory; ``recover()`` can be called again).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive.pool import _replay
from fsdp_interactive.pool._journal import JournalEntry
from fsdp_interactive.pool._pool_state import PoolState
from fsdp_interactive.pool._recovery_checks import (
    FROM_FOLDER,
    TAKE_SNAPSHOT,
    check_findable,
    check_folder,
    check_snapshot,
    check_world,
)
from fsdp_interactive.pool._recovery_progress import RecoveryProgress
from fsdp_interactive.pool._recovery_report import (
    RecoveryReport,
    calls_text,
    lost_names,
    rebuilt_names,
)
from fsdp_interactive.pool._script_record import replay_refusal
from fsdp_interactive.pool._slice import Part, ReplaySlice, beside, slice_for
from fsdp_interactive.pool._snapshots import SnapshotInfo, held_snapshots
from fsdp_interactive.pool.errors import RESTART, START, PoolNotRunning, RecoveryError, Step
from fsdp_interactive.pool.rank._snapshot_functions import restore_here

#: A :class:`~._pool.Pool` (not imported: the pool imports this module).
Pool = Any

#: After a restore that found its objects missing: the group is empty, so what works is
#: building them again and taking a new snapshot (recovering again would fail the same way).
REBUILD = Step(
    "run the cells that build them again, then take a new snapshot with {}",
    "fsdp_interactive.snapshot(model=..., optimizer=...)",
    "%fsdp snapshot MODEL OPTIMIZER",
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryPlan:
    """What a recovery will do: go back to ``snapshot`` (or to the disk ``checkpoint``),
    after replaying ``replay`` on ``world_size`` ranks (``None``: as many as the pool
    places), without the hosts in ``dropped_hosts``."""

    snapshot: SnapshotInfo | None
    checkpoint: str | None
    replay: tuple[JournalEntry, ...]
    world_size: int | None = None
    dropped_hosts: tuple[str, ...] = ()
    #: True when the caller named the snapshot (no newer one is taken instead).
    pinned: bool = False
    #: Every candidate entry's part in the replay, and why.
    sliced: ReplaySlice = field(default_factory=ReplaySlice)
    #: The journal's other entries since the snapshot's epoch, and why none is replayed.
    beside: tuple[Part, ...] = ()

    @property
    def target(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint}"
        assert self.snapshot is not None
        return self.snapshot.describe()

    def lines(self) -> list[str]:
        cells = ", ".join(e.label for e in self.replay) or "none"
        lines = [
            f"recover to the {self.target}",
            f"replay {calls_text(len(self.replay))}: {cells}",
        ]
        parts = sorted([*self.sliced.parts, *self.beside], key=lambda part: part.entry.id)
        lines += [f"  {part.line()}" for part in parts]
        if self.dropped_hosts:
            lines.append(f"without hosts {', '.join(self.dropped_hosts)} (lost)")
        if self.world_size is not None:
            lines.append(f"on {self.world_size} ranks")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


def make_plan(
    pool: Pool,
    from_: str | os.PathLike | None,
    world: int | None,
) -> RecoveryPlan:
    """The plan for ``pool.recover(from_, world=world)``, once the checks of
    :mod:`._recovery_checks` pass; :class:`RecoveryError` (nothing touched) for what they
    refuse, and when there is nothing to recover to."""
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise ValueError(f"world must be a number of ranks >= 1 or None, got {world!r}")
    check_world(pool, world)
    pool._faults.take_notices()
    book, journal = pool._snapshot_book, pool.journal
    dropped = tuple(pool._faults.lost_hosts)
    if from_ is not None and not isinstance(from_, str | os.PathLike):
        raise TypeError(f"from_ must be a snapshot id or a checkpoint folder, got {from_!r}")
    if from_ is not None and (os.sep in str(from_) or os.path.isdir(from_)):
        folder = os.path.abspath(os.fspath(from_))
        check_folder(pool, folder)
        sliced = slice_for(journal.replay_for(None), None)
        _check_script_replays(sliced, None, world, dropped, f"checkpoint {folder}")
        return RecoveryPlan(None, folder, sliced.replay, world, dropped, True, sliced)
    if from_ is not None:
        snapshot = book.get(str(from_))
        if snapshot is None:
            known = ", ".join(s.id for s in book.all()) or "none"
            raise RecoveryError(
                f"no snapshot {str(from_)!r} (known snapshots: {known}); nothing was changed"
            )
    else:
        snapshot = book.latest()
        if snapshot is None:
            raise RecoveryError(
                "no snapshot to recover to; nothing was changed", TAKE_SNAPSHOT, FROM_FOLDER
            )
    check_snapshot(pool, snapshot, pinned=from_ is not None)
    sliced = slice_for(journal.replay_for(snapshot.call), snapshot.names)
    taken_in = journal.entry(snapshot.call) if snapshot.call is not None else None
    _check_script_replays(sliced, taken_in, world, dropped, snapshot.describe())
    plan = RecoveryPlan(
        snapshot,
        None,
        sliced.replay,
        world,
        dropped,
        from_ is not None,
        sliced,
        tuple(beside(journal.entries, sliced, snapshot.call, journal.epoch.number)),
    )
    try:
        check_findable(journal, book, snapshot, sliced)
    except RecoveryError as refused:
        refused.plan = plan  # a dry run shows it with the refusal
        raise
    return plan


def _check_script_replays(
    sliced: ReplaySlice,
    taken_in: JournalEntry | None,
    world: int | None,
    dropped: Sequence[str],
    target: str,
) -> None:
    """:class:`RecoveryError` (nothing touched) when a script run the replay needs cannot be
    run again to its pause (:func:`._script_record.replay_refusal`)."""
    why = replay_refusal(sliced.replay, taken_in, world, dropped)
    if why is not None:
        raise RecoveryError(f"cannot recover to the {target}: {why}; nothing was changed")


def recover(
    pool: Pool,
    from_: str | os.PathLike | None,
    world: int | None,
    *,
    dry_run: bool,
    say: Callable[[str], None] | None,
) -> RecoveryReport | RecoveryPlan:
    """``pool.recover(from_, world=world, dry_run=dry_run, say=say)``: plan (the plan only
    with ``dry_run``) and carry the plan out, each line printed (or handed to ``say``);
    the pool's recovery watchers are told of a recovery that succeeds."""
    if pool.state is PoolState.STOPPED:
        raise PoolNotRunning("the pool is stopped (and its snapshots freed)", START)
    shown = say or _print
    with pool._faults.recovering():
        pool._faults.notice()  # a rank dead since the last call: no check asks the ranks
        try:
            plan = make_plan(pool, from_, world)
        except RecoveryError as refused:
            planned = getattr(refused, "plan", None)
            if dry_run and planned is not None:
                shown(str(planned))
            raise
        if dry_run:
            shown(str(plan))
            return plan
        report = execute(pool, plan, RecoveryProgress(say))
        pool._faults.lost_hosts = []
        shown(str(report))
        pool._recovery_watchers.tell(report)
    return report


def _print(line: str) -> None:
    print(line, flush=True)


def execute(pool: Pool, plan: RecoveryPlan, progress: RecoveryProgress) -> RecoveryReport:
    """Carry ``plan`` out on ``pool`` (see the module's docstring), showing each phase on
    ``progress`` from its first moment."""
    try:
        report = _execute(pool, plan, progress)
    except BaseException:
        progress.close(ended=False)
        raise
    progress.close(ended=True)
    return report


def _execute(pool: Pool, plan: RecoveryPlan, progress: RecoveryProgress) -> RecoveryReport:
    phases: dict[str, float] = {}
    began = time.monotonic()

    def lap(name: str) -> None:
        nonlocal began
        now = time.monotonic()
        phases[name] = phases.get(name, 0.0) + now - began
        began = now

    def fresh_group(drop_hosts: Sequence[str]) -> None:
        progress.phase("ending the old group")
        end_group(pool)
        lap("end")
        ranks = plan.world_size or pool._request.n
        progress.phase(
            f"starting a fresh group of {ranks} ranks" if ranks else "starting a fresh group"
        )
        start_group(pool, world=plan.world_size, drop_hosts=drop_hosts)
        lap("start")
        progress.done(
            f"a fresh group of {pool.world_size} ranks is up ({progress.seconds():.1f} s)"
        )

    if plan.snapshot is not None:
        pool._processes.forkers.precheck(plan.snapshot.id)
    fresh_group(plan.dropped_hosts)
    progress.phase("finding the snapshots the hosts hold")
    candidates = _candidates(pool, plan)
    lap("find")
    refused: list[str] = []
    for attempt, target in enumerate(candidates):
        sliced = (
            plan.sliced
            if target is plan.snapshot or plan.checkpoint is not None
            else slice_for(pool.journal.replay_for(target.call if target else None), target.names)
        )
        if attempt:
            fresh_group(())
        names = None if target is None else target.names
        locations = _replay.restored_locations(names)
        held_at = () if target is None else target.held_at
        again = ""
        try:
            outcome = _replay_slice(pool, sliced, locations, progress, held_at=held_at)
        except _replay.InitsLeftUnset as unset:
            # Never a success over uninitialized memory: the slow way, every draw made.
            again = str(unset)
            progress.done(f"{unset}; replaying again with every initialization run")
            lap("replay")
            fresh_group(())
            outcome = _replay_slice(pool, sliced, locations, progress, skip_inits=False)
        lap("replay")
        source = plan.checkpoint if target is None else target.id
        progress.phase(f"loading {source}")
        try:
            restored = _restore(pool, source)
        except _Refused as refusal:
            refused.append(f"{source}: {refusal}")
            older = candidates[attempt + 1] if attempt + 1 < len(candidates) else None
            tried = f"; trying the older snapshot {older.id}" if older is not None else ""
            progress.done(f"{source} refused ({refusal}){tried}")
            lap("restore")
            continue
        lap("restore")
        journal = pool.journal
        journal.set_base(sliced.replay, None if target is None else target.id)
        after = set(restored.pop("defined", ()))
        call = None if target is None else target.call
        lost = lost_names(journal.names, after, journal.entries, sliced, call)
        journal.names = after
        return RecoveryReport(
            plan,
            target,
            sliced.replay,
            pool.world_size,
            dict(phases),
            restored,
            tuple(refused),
            outcome,
            rebuilt_names(after, restored.get("names") or {}),
            lost,
            again,
        )
    _fresh_group(pool)
    raise RecoveryError(
        "no snapshot could be restored; the pool runs a fresh, empty group:\n  "
        + "\n  ".join(refused or ["nothing to restore"])
    )


def _candidates(pool: Pool, plan: RecoveryPlan) -> list[SnapshotInfo | None]:
    """What to try, in order: the plan's target (or a newer snapshot the hosts hold, when
    none was named), then older snapshots the hosts hold."""
    if plan.checkpoint is not None:
        return [None]
    held = held_snapshots(pool)
    assert plan.snapshot is not None
    if plan.pinned:
        if plan.snapshot.id not in held:
            _fresh_group(pool)
            raise RecoveryError(
                f"snapshot {plan.snapshot.id} is not held by any remaining host (held: "
                f"{', '.join(sorted(held)) or 'none'}); the pool runs a fresh, empty group"
            )
        newest = plan.snapshot
    else:
        newest = held[max(held)] if held else plan.snapshot
    older = [held[i] for i in sorted(held, reverse=True) if i < newest.id]
    return [newest, *older]


def _replay_slice(pool: Pool, *args: Any, **options: Any) -> _replay.ReplayOutcome:
    """The replay phase (:func:`._replay.replay`, given ``args`` and ``options``); the first
    failure ends the recovery (:class:`~._replay.InitsLeftUnset` is the caller's, unless
    the replay was asked to skip no initialization)."""
    try:
        return _replay.replay(pool, *args, **options)
    except _replay.InitsLeftUnset:
        if options.get("skip_inits", True):
            raise
        _fresh_group(pool)
        raise RecoveryError(
            "the replay left parameters uninitialized although it skipped no "
            "initialization, so the recovery stopped; the pool runs a fresh, empty group"
        ) from None
    except _replay.ReplayFailed as failed:
        _fresh_group(pool)
        error = failed.error
        raise RecoveryError(
            f"replaying {failed.entry.label} failed, so the recovery stopped; the pool runs a "
            f"fresh, empty group. The call's error:\n{getattr(error, 'what_happened', error)}"
        ) from error
    except Exception as error:
        _fresh_group(pool)
        raise RecoveryError(
            f"the replay could not be prepared or finished, so the recovery stopped; the "
            f"pool runs a fresh, empty group. The error:\n{getattr(error, 'what_happened', error)}"
        ) from error


class _Refused(Exception):
    """The ranks refused to restore a snapshot (corrupt, incomplete, another model)."""


#: Rank-side exception names that mean "this snapshot cannot be used" rather than a bug.
_REFUSALS = (
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "CheckpointError",
    "SnapshotError",
)


def _restore(pool: Pool, source: str | None) -> Any:
    """Every rank loads ``source`` (a snapshot id or a checkpoint folder) into the objects
    its namespace holds under the recorded names; rank 0's report."""
    from fsdp_interactive.pool.errors import RankError

    try:
        return pool._call(restore_here, (source,), {}, stream=False)[0]  # output not shown
    except RankError as error:
        names = {name for name, _ in error.errors.values()}
        if "SnapshotObjectsError" in names:
            first = next(m for n, m in error.errors.values() if n == "SnapshotObjectsError")
            _fresh_group(pool)
            raise RecoveryError(
                f"the replayed cells did not put back every object {source} restores into, "
                f"so nothing was restored and the pool runs a fresh, empty group: {first}",
                REBUILD,
                RESTART,
            ) from None
        if names & set(_REFUSALS):
            first = error.errors[min(error.errors)]
            raise _Refused(f"{first[0]}: {first[1]}") from None
        raise


def end_group(pool: Pool) -> None:
    """End what is left of ``pool``'s group, keeping the engine forkers (and so the
    snapshots in host memory): ranks still alive are killed first, since a rank blocked in
    a wedged collective would not leave otherwise."""
    pool._faults.finish_cleanup()
    if pool.running and pool.owns_engines:
        pool._processes.kill_engines()
    pool._teardown(keep_forker=True)


def start_group(pool: Pool, *, world: int | None, drop_hosts: Sequence[str]) -> None:
    """Start ``pool`` again on ``world`` ranks (``None``: as placed before) without the
    engines of ``drop_hosts``; the reduced placement stays the pool's from now on."""
    if drop_hosts:
        pool._cluster_kwargs, remaining = without_hosts(pool._cluster_kwargs, drop_hosts)
        if world is None:
            world = remaining
    if world is not None:
        request = pool._request
        devices = request.devices
        if isinstance(devices, tuple):
            if world > len(devices):
                raise RecoveryError(f"world={world} needs more devices than {list(devices)}")
            devices = devices[:world]
        pool._request = dataclasses.replace(request, n=world, devices=devices)
    # The recovery reports the new group itself; the topology table would be noise here.
    shown, pool.show_topology = pool.show_topology, False
    try:
        pool.start()
    finally:
        pool.show_topology = shown


def without_hosts(
    cluster_kwargs: Mapping[str, Any], hosts: Sequence[str]
) -> tuple[dict[str, Any], int | None]:
    """``cluster_kwargs`` whose ssh launcher no longer starts engines on ``hosts``, and the
    number of engines left (``None`` when the launcher is not ipyparallel's ssh one, whose
    hosts this cannot change)."""
    import copy

    kwargs = dict(cluster_kwargs)
    config = kwargs.get("config")
    ssh = getattr(config, "SSHEngineSetLauncher", None) if config is not None else None
    engines = getattr(ssh, "engines", None) if ssh is not None else None
    if not isinstance(engines, Mapping) or not engines:
        raise RecoveryError(
            f"hosts {', '.join(hosts)} are lost, and only the ssh launcher's hosts can be "
            "changed here; start the pool again on the hosts that remain"
        )
    config = copy.deepcopy(config)
    left = {host: count for host, count in engines.items() if host not in set(hosts)}
    if not left:
        raise RecoveryError("every host of the pool is lost; start a new pool")
    config.SSHEngineSetLauncher.engines = left
    kwargs["config"] = config
    total = sum(c if isinstance(c, int) else int(c[0]) for c in left.values())
    return kwargs, total


def _fresh_group(pool: Pool) -> None:
    """After a failed recovery: a fresh, empty group (or a stopped pool if even that
    fails), and a journal epoch with nothing behind it."""
    try:
        end_group(pool)
        pool.start()
    except Exception as error:  # reported by the RecoveryError the caller raises
        log.debug("could not start a fresh group after a failed recovery: %s", error)
