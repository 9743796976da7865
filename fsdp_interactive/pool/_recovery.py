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
   (:mod:`fsdp_interactive._prechecked`), with the CPU time that ending and starting
   the group leave idle; the restore then hashes only the files it did not record (a
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
from fsdp_interactive.pool._recovery_checks import (
    FROM_FOLDER,
    TAKE_SNAPSHOT,
    check_folder,
    check_snapshot,
    check_world,
)
from fsdp_interactive.pool._script_record import replay_refusal
from fsdp_interactive.pool._slice import ReplaySlice, slice_for
from fsdp_interactive.pool._snapshots import SnapshotInfo, held_snapshots
from fsdp_interactive.pool.errors import RecoveryError
from fsdp_interactive.pool.rank._snapshot_calls import restore_here

#: A :class:`~._pool.Pool` (not imported: the pool imports this module).
Pool = Any

log = logging.getLogger(__name__)


def _calls(count: int) -> str:
    return f"{count} call" if count == 1 else f"{count} calls"


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

    @property
    def target(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint}"
        assert self.snapshot is not None
        return self.snapshot.describe()

    def lines(self) -> list[str]:
        cells = ", ".join(e.label for e in self.replay) or "none"
        lines = [f"recover to the {self.target}", f"replay {_calls(len(self.replay))}: {cells}"]
        lines += [f"  {line}" for line in self.sliced.lines()]
        if self.dropped_hosts:
            lines.append(f"without hosts {', '.join(self.dropped_hosts)} (lost)")
        if self.world_size is not None:
            lines.append(f"on {self.world_size} ranks")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass(frozen=True)
class RecoveryReport:
    """What a recovery did: the ``plan``, the snapshot it went back to (``snapshot``; may
    differ from the plan's when a newer one was found or the planned one was refused),
    the calls it ``replayed``, the new ``world_size``, the seconds of each phase and the
    ranks' own restore report (``restored``: rank 0's)."""

    plan: RecoveryPlan
    snapshot: SnapshotInfo | None
    replayed: tuple[JournalEntry, ...]
    world_size: int
    phases: Mapping[str, float] = field(default_factory=dict)
    restored: Any = None
    refused: tuple[str, ...] = ()
    #: What the replay did beyond running the entries (:class:`~._replay.ReplayOutcome`).
    replay_outcome: _replay.ReplayOutcome | None = None

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def summary(self) -> str:
        """``recovered to the snapshot s000004 of step 40 (taken 12 s ago) in 4.1 s``."""
        target = self.plan.target if self.snapshot is None else self.snapshot.describe()
        return f"recovered to the {target} in {self.seconds:.1f} s"

    def lines(self) -> list[str]:
        cells = ", ".join(e.label for e in self.replayed) or "none"
        phases = ", ".join(f"{name} {secs:.2f} s" for name, secs in self.phases.items())
        lines = [
            self.summary(),
            f"{self.world_size} ranks; replayed {_calls(len(self.replayed))}: {cells}",
            f"phases: {phases}",
        ]
        outcome = self.replay_outcome
        if outcome is not None and outcome.skipped_inits:
            lines.append(
                f"replay: {outcome.skipped_inits} parameter initializations skipped (the "
                f"snapshot overwrites them), {outcome.run_inits} run"
            )
        if outcome is not None:
            lines += [
                f"replay: {label} ran without rank(s) {', '.join(map(str, ranks))}'s original "
                "random generators (their report was lost with the rank)"
                for label, ranks in outcome.without_generators
            ]
        lines += [f"refused: {reason}" for reason in self.refused]
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
    return RecoveryPlan(snapshot, None, sliced.replay, world, dropped, from_ is not None, sliced)


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


def execute(pool: Pool, plan: RecoveryPlan, say: Callable[[str], None]) -> RecoveryReport:
    """Carry ``plan`` out on ``pool`` (see the module's docstring); ``say`` shows progress."""
    phases: dict[str, float] = {}
    began = time.monotonic()

    def lap(name: str) -> None:
        nonlocal began
        now = time.monotonic()
        phases[name] = phases.get(name, 0.0) + now - began
        began = now

    if plan.snapshot is not None:
        pool._processes.forkers.precheck(plan.snapshot.id)
    end_group(pool)
    lap("end")
    start_group(pool, world=plan.world_size, drop_hosts=plan.dropped_hosts)
    lap("start")
    say(f"recovery: a fresh group of {pool.world_size} ranks is up")
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
            end_group(pool)
            start_group(pool, world=plan.world_size, drop_hosts=())
            lap("start")
        names = None if target is None else target.names
        outcome = _replay_slice(pool, sliced, _replay.restored_locations(names), say)
        lap("replay")
        source = plan.checkpoint if target is None else target.id
        try:
            restored = _restore(pool, source)
        except _Refused as refusal:
            refused.append(f"{source}: {refusal}")
            older = candidates[attempt + 1] if attempt + 1 < len(candidates) else None
            tried = f"; trying the older snapshot {older.id}" if older is not None else ""
            say(f"recovery: {source} refused ({refusal}){tried}")
            lap("restore")
            continue
        lap("restore")
        pool.journal.set_base(sliced.replay, None if target is None else target.id)
        return RecoveryReport(
            plan,
            target,
            sliced.replay,
            pool.world_size,
            dict(phases),
            restored,
            tuple(refused),
            outcome,
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


def _replay_slice(
    pool: Pool, sliced: ReplaySlice, restored: Sequence[str], say: Callable[[str], None]
) -> _replay.ReplayOutcome:
    """The replay phase (:mod:`._replay`); the first failure ends the recovery."""
    try:
        return _replay.replay(pool, sliced, restored, say)
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
                f"so nothing was restored and the pool runs a fresh, empty group: {first}"
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
