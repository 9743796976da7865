"""``restore_snapshot``: a snapshot back into the objects the replayed cells recreated, and
:class:`RestoreReport`, what it did (plain data, which travels to the kernel)."""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _model_state
from fsdp_interactive.checkpoint._format import _manifest
from fsdp_interactive.checkpoint._format._snapshot_record import SnapshotRecord
from fsdp_interactive.checkpoint._fsdp1_quietly import quietly
from fsdp_interactive.checkpoint._load import check_folder, load_with_state
from fsdp_interactive.checkpoint._rng import RNGState
from fsdp_interactive.checkpoint._snapshot._locate import Completed, Located, complete, locate
from fsdp_interactive.checkpoint._snapshot._object_locations import NOT_A_GLOBAL, resolve
from fsdp_interactive.checkpoint._snapshot._place import snapshot_ranks
from fsdp_interactive.checkpoint._snapshot._snapshot_handle import INFLIGHT
from fsdp_interactive.checkpoint._snapshot._store import RECORD_FILE, id_number, read_folder_record
from fsdp_interactive.checkpoint._snapshot._take import RNG_KEY
from fsdp_interactive.checkpoint.errors import IncompatibleCheckpointError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreReport:
    """What :func:`restore_snapshot` did (identical on every rank).

    ``names`` maps each restored keyword (``"model"``, ``"optimizer"``, the stateful
    keywords) to the variable it was loaded into (``"<objects>"`` when given through
    ``objects=``). ``copied_files`` / ``copied_bytes``: files sent between hosts so that
    every host held the whole snapshot (a host that lost its folder, or ranks placed on
    other hosts than when it was taken); ``repaired_files``: copies that failed their
    checksum and were replaced from a good copy on another host. ``missing_keys`` /
    ``unexpected_keys`` as in :class:`~fsdp_interactive.checkpoint.LoadReport`
    (``strict=False`` only). ``phases``: seconds per phase (``"locate"``, ``"verify"``,
    ``"copy"``, ``"load"``); ``seconds``: the whole call.
    """

    id: str
    step: int | None
    saved_world_size: int
    world_size: int
    names: dict[str, str]
    copied_files: int
    copied_bytes: int
    repaired_files: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    prechecked_files: int = 0

    @property
    def resharded(self) -> bool:
        return self.saved_world_size != self.world_size


def _agreed(ranks: Ranks, fn: Any) -> Any:
    """``fn()`` on every rank; an error on any rank raises the lowest rank's on all."""
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:
        error = exc
    ranks.agree(error)
    return result


@dataclass(frozen=True)
class _Source:
    """What a restore reads: a snapshot on the hosts, or a checkpoint folder they share."""

    id: str
    folder: Path
    names: dict[str, Any]
    keys: list[str] | None
    manifest: _manifest.Manifest
    located: Located | None = None
    unnamed: str = NOT_A_GLOBAL


def _is_folder(source: object) -> bool:
    """A checkpoint folder rather than a snapshot id: a path (snapshot ids hold no ``/``)."""
    if isinstance(source, os.PathLike):
        return True
    return (
        isinstance(source, str)
        and id_number(source) is None
        and (os.sep in source or os.path.isdir(source))
    )


def _from_folder(folder: Path, ranks: Ranks) -> _Source:
    """A checkpoint folder every rank sees: a persisted snapshot (it holds the record, so its
    names) or a plain checkpoint (no names: the objects are given through ``objects``)."""

    def read() -> tuple[_manifest.Manifest, SnapshotRecord | None]:
        manifest, _, _ = check_folder(folder)
        has_record = (folder / RECORD_FILE).is_file()
        return manifest, read_folder_record(folder) if has_record else None

    manifest, record = _agreed(ranks, read)
    if record is not None:
        return _Source(str(folder), folder, record.names, record.keys, manifest)
    names = {
        "model": None,
        "optimizer": None,
        "stateful": {k: None for k in manifest.stateful if k != RNG_KEY},
    }
    unnamed = (
        f"{folder} is a checkpoint saved by checkpoint.save, not a snapshot; or load it "
        "with checkpoint.load(folder, model, optimizer)"
    )
    return _Source(str(folder), folder, names, None, manifest, unnamed=unnamed)


def _find(snapshot_id: str | os.PathLike | None, ranks: Ranks) -> _Source:
    if snapshot_id is not None and _is_folder(snapshot_id):
        return _from_folder(Path(os.fspath(snapshot_id)).absolute(), ranks)
    located = locate(snapshot_id, ranks)  # which checks that it is an id
    record = located.record
    return _Source(located.id, located.folder, record.names, record.keys, located.manifest, located)


def _check_keys(source: _Source, model: nn.Module) -> dict[str, Any]:
    """The model's state (``_model_state.model_state``), once its keys are the snapshot's."""
    state = _model_state.model_state(model)
    current = set(state)
    saved = set(source.keys or ())
    missing, unexpected = sorted(current - saved), sorted(saved - current)
    if not (missing or unexpected):
        return state
    parts = []
    if missing:
        parts.append(f"missing keys (in the model, not in the snapshot): {missing}")
    if unexpected:
        parts.append(f"unexpected keys (in the snapshot, not in the model): {unexpected}")
    raise IncompatibleCheckpointError(
        f"snapshot {source.id} is of another model (strict=True): "
        + "; ".join(parts)
        + "; restore it into the model it was taken of (run the cells that build it), "
        "or pass strict=False to load the common keys",
        missing_keys=missing,
        unexpected_keys=unexpected,
    )


@quietly
def restore_snapshot(
    snapshot_id: str | os.PathLike | None = None,
    namespace: Mapping[str, Any] | None = None,
    *,
    strict: bool = True,
    objects: Mapping[str, Any] | None = None,
) -> RestoreReport:
    """Load the snapshot ``snapshot_id`` (``None``: the newest on any host) into the objects
    found under its recorded names in ``namespace``; collective over every rank, at any
    world size.

    ``snapshot_id`` may also be a checkpoint folder every rank sees (a path): one written
    by :func:`persist_snapshot` restores like the snapshot it came from; a plain
    checkpoint of :func:`fsdp_interactive.checkpoint.save` records no names, so every
    object it holds comes through ``objects``.

    ``namespace``: the mapping the names are looked up in (the engine's user namespace;
    ``None``: the calling code's globals). ``objects`` (keyword -> object, e.g.
    ``{"model": m}``) overrides recorded names, for objects the snapshot found no global
    name for. The model, the optimizer (when the snapshot holds its state), every stateful
    keyword's object and each rank's random generators are restored exactly; at another
    world size DCP reshards the model and optimizer, and per-rank objects reshard as
    :func:`fsdp_interactive.checkpoint.load` describes (random generators: rank ``r``
    continues saved rank ``r``'s streams where it exists).

    In order, every check on every rank before anything is loaded:

    1. finds the snapshot on the hosts of the group (:class:`SnapshotError` if none holds
       it); looks its names up (:class:`SnapshotError` naming each name that is no longer
       defined, and what to run);
    2. ``strict=True``: refuses a snapshot of another model, naming the mismatching keys
       (:class:`IncompatibleCheckpointError`); ``strict=False`` loads the common keys;
    3. checks every host's copy against its checksums, and sends every host the files it
       lacks (a lost host's ranks' files come from the copy the following host kept; a
       damaged copy is replaced from a good one): :class:`CorruptCheckpointError` when a
       file's only copies are damaged, :class:`SnapshotError` when a file is on no host of
       the group (for example two neighbouring hosts lost);
    4. loads, all-or-nothing, through :func:`fsdp_interactive.checkpoint.load`.

    Every rank raises the same error, and nothing is written into the objects, when a
    check fails. The snapshot itself is never changed, except that hosts gain the files
    they lacked. A rank that dies, or a host that goes away, during a restore makes the
    others fail (gloo's closed connection, at the latest the group's timeout) with the
    objects possibly half loaded: restore again on a new group. A background snapshot of
    this process still being written is waited for first.
    """
    if namespace is None:
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        namespace = caller.f_globals if caller is not None else {}
    if not isinstance(namespace, Mapping):
        raise TypeError(
            f"namespace must be a mapping of names (e.g. globals()), got {type(namespace).__name__}"
        )
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    if objects is not None and not isinstance(objects, Mapping):
        raise TypeError(
            f"objects must be a mapping of keywords to objects, got {type(objects).__name__}"
        )
    started = time.monotonic()
    INFLIGHT.wait()
    ranks = snapshot_ranks()
    source = _find(snapshot_id, ranks)
    phases = {"locate": time.monotonic() - started}
    manifest = source.manifest
    model, optimizer, stateful, used = _agreed(
        ranks,
        lambda: resolve(
            source.names, manifest.has_optimizer, namespace, objects or {}, source.unnamed
        ),
    )
    model_state = None
    if strict and source.keys is not None:
        model_state = _agreed(ranks, lambda: _check_keys(source, model))
    completed = complete(source.located, ranks) if source.located else Completed()
    phases.update(completed.phases)
    loading = time.monotonic()
    if RNG_KEY in manifest.stateful:
        stateful = {**stateful, RNG_KEY: RNGState()}
    loaded = load_with_state(
        source.folder,
        model,
        optimizer,
        stateful=stateful,
        strict=strict,
        verify=source.located is None,  # a snapshot's copies were checked by complete()
        in_place=True,
        model_state=model_state,  # complete() changed no object since the key check
        # A snapshot of the root was authenticated by its seal (the pool's key) when it
        # was located, in a private folder; a folder the caller names must be the user's.
        trusted=source.located is not None,
    )
    phases["load"] = time.monotonic() - loading
    report = RestoreReport(
        id=source.id,
        step=manifest.step,
        saved_world_size=manifest.world_size,
        world_size=ranks.size,
        names=used,
        copied_files=completed.copied_files,
        copied_bytes=completed.copied_bytes,
        repaired_files=completed.repaired,
        prechecked_files=completed.prechecked_files,
        missing_keys=loaded.missing_keys,
        unexpected_keys=loaded.unexpected_keys,
        phases=phases,
        seconds=time.monotonic() - started,
    )
    logger.info(
        "restored snapshot %s (step %s, %d -> %d ranks) in %.3fs: %s",
        source.id,
        manifest.step,
        manifest.world_size,
        ranks.size,
        report.seconds,
        {k: round(v, 3) for k, v in phases.items()},
    )
    return report
