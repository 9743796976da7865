"""``fsdp_interactive.snapshot(...)``: the training state into host memory, published
atomically on every host, with a copy of each host's files on the next host."""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_interactive import _notices
from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _pipeline
from fsdp_interactive.checkpoint._format._raw_storage import RawWriter
from fsdp_interactive.checkpoint._format._snapshot_record import SnapshotRecord
from fsdp_interactive.checkpoint._fsdp1_quietly import quietly
from fsdp_interactive.checkpoint._rng import RNGState
from fsdp_interactive.checkpoint._save_handle import INFLIGHT as SAVES
from fsdp_interactive.checkpoint._single_process import single_process_quietly
from fsdp_interactive.checkpoint._snapshot import _plan, _publish, _room
from fsdp_interactive.checkpoint._snapshot._object_locations import (
    MODEL,
    OPTIMIZER,
    findable,
    given_paths,
    locations,
    record_names,
    unlocated_error,
)
from fsdp_interactive.checkpoint._snapshot._place import snapshot_ranks
from fsdp_interactive.checkpoint._snapshot._snapshot_handle import INFLIGHT, SnapshotHandle
from fsdp_interactive.checkpoint._stateful import check_stateful
from fsdp_interactive.checkpoint._step_counter import StepCounter
from fsdp_interactive.checkpoint.errors import CheckpointError, SnapshotLocationWarning
from fsdp_interactive.fsdp._fqn_state import map_tensors

logger = logging.getLogger(__name__)

#: The name under which every snapshot keeps each rank's random generators (a
#: :class:`~fsdp_interactive.checkpoint.RNGState`, per rank).
RNG_KEY = "snapshot_rng"


def snapshot(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | StepCounter | None = None,
    keep_last: int = 1,
    background: bool = False,
    **stateful: Any,
) -> SnapshotRecord | SnapshotHandle:
    """Snapshot the training state into host memory; collective over every rank.

    Call it on every rank, with the same arguments, from a training loop (every K steps)
    or a cell. It keeps, in this host's snapshot folder (``$FSDPI_SNAPSHOT_ROOT``, a pool
    sets it to a folder under ``/dev/shm``), each rank's shards of ``model`` and
    ``optimizer``, each rank's random generators (CPU and CUDA, as
    :class:`~fsdp_interactive.checkpoint.RNGState` saves them), and the ``stateful``
    keywords' objects (LR schedulers, samplers, step counters: anything with
    ``state_dict`` / ``load_state_dict``; see :func:`fsdp_interactive.checkpoint.save`
    for global and per-rank ones). It records where each object is in the calling code's
    globals, for :func:`restore_snapshot` after the cells that create them were run
    again: what the call wrote for it when that is a variable or an attribute path that
    names it (``model=run.model`` records ``run.model``), else where it is found by
    identity (a variable, or an attribute path such as ``trainer.model_wrapped``). Inside
    a pool's notebook call, an object found nowhere there is refused
    (:class:`~fsdp_interactive.checkpoint.SnapshotObjectsError`, on every rank, before
    anything is written), and so is one whose variable a recovery would not bind again
    (bound only in a ``--no-replay`` cell, in the cell taking the snapshot, or by
    ``Pool.push``) unless another location of it would be: it is then recorded there,
    with a :class:`~fsdp_interactive.checkpoint.SnapshotLocationWarning` saying why.

    ``step``: the training step (an int), recorded in the snapshot's record; a
    :class:`~fsdp_interactive.checkpoint.StepCounter` is also kept as a stateful object
    (under ``step``) and so restored in place, where a plain int variable cannot be.

    * With ranks on several hosts, every rank's files also go to the following host (hosts
      in the order their names first appear in rank order), over gloo: one lost host
      loses no file. Every host holds the metadata and the descriptions.
    * Published atomically per host (one rename once complete there). Snapshots of the
      same objects (the same locations) beyond the newest ``keep_last`` (an int >= 1) are
      removed only after every host published the new one; snapshots of other objects
      are kept. The record returned names those removed (``dropped``).
    * Refused before anything is written, with the same error on every rank and the
      previous snapshot kept: :class:`~fsdp_interactive.checkpoint.SnapshotSpaceError`
      when a host's folder lacks room for what it would keep; ``TypeError`` /
      ``ValueError`` for bad arguments (``model`` not a module, ``keep_last`` < 1, a
      keyword starting with ``_`` or named ``snapshot_rng``, an object without
      ``state_dict``/``load_state_dict``).
    * Each rank writes its shards' bytes as they are in memory into one file in host
      memory (no ``torch.save`` framing; :mod:`fsdp_interactive.checkpoint._format._raw_storage`),
      taking the file's checksum (XXH3-64) on the way; the manifest holding the checksums
      and the record are sealed with the pool's key (:mod:`.._format._snapshot_seal`).
    * ``background=False``: returns the :class:`SnapshotRecord` once published.
      ``background=True``: writes the state into host memory in the calling thread (the
      blocking part, in ``handle.seconds``: that copy is the staging), then copies it to
      the following host and publishes on a background thread (its collectives on a
      gloo group of their own) and returns a :class:`SnapshotHandle` at once; changing
      the model or the objects afterwards does not change what is written. A snapshot
      started while this process's previous background snapshot is still published waits
      for it first (so do :func:`restore_snapshot` and :func:`persist_snapshot`). A
      failure of the write raises from the call itself; one of the publishing, on the
      handle.
    * After publishing, rank 0 publishes the notice ``{"kind": "snapshot", **record}``
      (:mod:`fsdp_interactive._notices`); ``record.call`` is the notebook call current
      when ``snapshot`` was called.

    Faults: if a rank dies, a collective wedges or a host goes away while a snapshot is
    written, the other ranks' calls fail (gloo's closed connection, at the latest the
    process group's timeout) and the snapshot is not published on the hosts that had not
    renamed it yet; its dot-folders are never listed and the next snapshot removes them.
    Every snapshot published before stays whole: the shared memory outlives the ranks.
    What is not kept: variables other than the objects given, data loader iterators,
    and the memory of a lost host (its ranks' files live on in the following host's copy).

    While a recovery replays the call that contains it
    (:func:`fsdp_interactive._notices.replaying`), nothing is written: a new snapshot would
    replace the one being recovered to. The newest snapshot's record (or a finished handle
    holding it) is returned instead, so the replayed code runs on unchanged.
    """
    if _notices.replaying():
        return _while_replaying(background)
    frame = inspect.currentframe()
    caller = frame.f_back if frame is not None else None
    namespace = caller.f_globals if caller is not None else {}
    return take(
        model,
        optimizer,
        step=step,
        keep_last=keep_last,
        background=background,
        stateful=stateful,
        namespace=namespace,
        given=given_paths(caller, (MODEL, OPTIMIZER)),
    )


def _while_replaying(background: bool) -> SnapshotRecord | SnapshotHandle | None:
    """What ``snapshot()`` returns while a recovery replays it: the newest snapshot's
    record, as a finished handle for ``background=True`` (``None`` when there is none)."""
    from fsdp_interactive.checkpoint._snapshot._store import list_snapshots

    held = list_snapshots()
    newest = held[-1] if held else None
    logger.info(
        "snapshot() skipped: a recovery replays this call (newest snapshot: %s)",
        newest.id if newest else None,
    )
    if not background or newest is None:
        return newest
    handle = SnapshotHandle(newest.id, 0.0)
    handle.set_result(newest)
    return handle


def _check(
    model: Any, optimizer: Any, step: Any, keep_last: Any, background: Any, stateful: Mapping
) -> None:
    if model is None:
        raise TypeError("snapshot() needs model=<the sharded torch module> (got None)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    if not isinstance(background, bool):
        raise TypeError(f"background must be True or False, got {background!r}")
    reserved = sorted(k for k in stateful if k.startswith("_") or k == RNG_KEY)
    if reserved:
        raise ValueError(
            f"stateful keywords {reserved} are reserved (names starting with '_' and "
            f"{RNG_KEY!r}, which holds every rank's random generators); use other keywords"
        )


def _tensor_count(state: Any) -> int:
    count = 0

    def one(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    map_tensors(state, one)
    return count


@quietly
def take(
    model: Any,
    optimizer: Any,
    *,
    step: int | StepCounter | None,
    keep_last: int,
    background: bool,
    stateful: Mapping[str, Any],
    namespace: Mapping[str, Any],
    given: Mapping[str, str] | None = None,
) -> SnapshotRecord | SnapshotHandle:
    """:func:`snapshot` with the namespace its names are looked up in given explicitly
    (``given``: what the caller wrote for each keyword, :func:`._object_locations.given_paths`)."""
    started, created, call = time.monotonic(), time.time(), _notices.current_call()
    if isinstance(step, StepCounter):  # kept as a stateful object, restored in place
        stateful = {**stateful, "step": step}
        step = int(step)
    _check(model, optimizer, step, keep_last, background, stateful)
    names = record_names(namespace, model, optimizer, stateful, given)
    # The snapshot in flight publishes over the same group: its collectives end first.
    INFLIGHT.wait()
    if call is not None:
        # In a pool's notebook call a recovery will look for every object where it is now:
        # refused, on every rank alike, when one could not be found again.
        snapshot_ranks().agree(unlocated_error(names, optimizer, stateful))
        objects = {MODEL: model, **({OPTIMIZER: optimizer} if optimizer is not None else {})}
        names, notes, refusal = findable(namespace, names, {**objects, **stateful})
        snapshot_ranks().agree(refusal)
        for note in notes:
            warnings.warn(f"snapshot: {note}", SnapshotLocationWarning, stacklevel=3)
    if background:
        # One write of the training state at a time per process (a checkpoint save waits
        # for a snapshot in flight likewise): an async save still writing ends first.
        SAVES.make_room("wait", Ranks(local=True))
    ranks = snapshot_ranks()
    objects = check_stateful({**stateful, RNG_KEY: RNGState()})
    captured = _pipeline.capture(model, optimizer, objects, ranks)
    plan = _plan.plan(
        ranks,
        need=_room.estimate(captured.local_bytes(), _tensor_count(captured.state)),
        keep_last=keep_last,
        step=step,
        created=created,
        started=started,
        call=call,
        names=names,
        keys=sorted(captured.state["model"]),
        held_at=_module_locations(namespace, [model, *stateful.values()]),
    )
    try:
        written = write(captured.state, plan, ranks)
    except BaseException:
        _publish.abandon(plan)
        raise
    contents = captured.contents
    del captured
    if not background:
        return _publish.finish(plan, contents, ranks, written, blocking=None)
    handle = SnapshotHandle(plan.id, plan.elapsed())
    logger.info(
        "snapshot %s written in %.3fs; publishing in the background", plan.id, handle.seconds
    )

    def publish() -> SnapshotRecord:
        return _publish.finish(plan, contents, ranks, written, blocking=handle.seconds)

    def failed(exc: BaseException) -> None:
        logger.warning("background snapshot %s failed: %s", plan.id, exc)

    INFLIGHT.hold(handle)
    handle.run_in_thread(publish, f"snapshot:{plan.id}", failed)
    return handle


def _module_locations(namespace: Mapping[str, Any], objects: list[Any]) -> list[str]:
    """Every location of the modules among ``objects`` in ``namespace`` (names and
    attribute paths): where a recovery finds initialized tensors the snapshot writes."""
    found: list[str] = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            found += [w for w in locations(namespace, obj) if w not in found]
    return found


def write(state: dict[str, Any], plan: _plan.SnapshotPlan, ranks: Ranks) -> RawWriter:
    """Every rank's shards of ``state`` into its host's unfinished folder of ``plan``, in
    the raw format (collective: DCP plans the items and rank 0 writes the metadata); the
    writer, which holds this rank's files' checksums."""
    began = time.monotonic()
    writer = RawWriter(plan.partial)
    try:
        with single_process_quietly():
            dcp.save(
                state,
                storage_writer=writer,
                process_group=ranks.group,
                no_dist=not ranks.distributed,
            )
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"writing snapshot data to {plan.partial} failed: {exc}") from exc
    logger.info(
        "rank %d wrote %d bytes of snapshot %s in %.3fs",
        ranks.rank,
        sum(r.size for r in writer.files.values()),
        plan.id,
        time.monotonic() - began,
    )
    return writer
