"""``persist_snapshot``: a snapshot promoted to a disk checkpoint ``checkpoint.load`` reads."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from fsdp_interactive import _private_files
from fsdp_interactive.checkpoint import _checkpoint_folders
from fsdp_interactive.checkpoint._format import _manifest, _owner_seal
from fsdp_interactive.checkpoint._format._checksums import new_checksum
from fsdp_interactive.checkpoint._format._manifest import CheckpointRecord
from fsdp_interactive.checkpoint._pipeline import _check_shared
from fsdp_interactive.checkpoint._snapshot import _store
from fsdp_interactive.checkpoint._snapshot._locate import Located, locate
from fsdp_interactive.checkpoint._snapshot._place import snapshot_ranks
from fsdp_interactive.checkpoint._snapshot._snapshot_handle import INFLIGHT
from fsdp_interactive.checkpoint.errors import SnapshotError

logger = logging.getLogger(__name__)

_COPY_CHUNK = 16 << 20


def _copy_checked(source: Path, target: Path, expected: _manifest.FileRecord) -> str | None:
    """Copy ``source`` to ``target`` (fsynced), taking its checksum on the way; a problem
    or ``None``."""
    digest = new_checksum(expected.algorithm)
    size = 0
    try:
        src_fd = _private_files.open_regular(source)
        with os.fdopen(src_fd, "rb") as src, open(target, "wb") as dst:
            while chunk := src.read(_COPY_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except OSError as exc:
        return f"copying {source} to {target} failed: {exc}"
    if size != expected.size or digest.hexdigest() != expected.digest:
        return f"{source}: does not match its checksum (damaged); nothing was persisted"
    return None


def _assignments(located: Located) -> dict[str, int]:
    """File -> the rank that copies it: a rank of the first host holding it, spread."""
    hosts = located.hosts
    holding = {host: set(located.good_size(host)) for host in hosts.order}
    chosen, lost = {}, []
    for index, name in enumerate(sorted(located.manifest.files)):
        owners = [h for h in hosts.order if name in holding[h]]
        if not owners:
            lost.append(name)
            continue
        mates = hosts.ranks_on(owners[0])
        chosen[name] = mates[index % len(mates)]
    if lost:
        raise SnapshotError(
            f"snapshot {located.id} is incomplete on the hosts of this group: {lost} are on "
            "none of them; restore_snapshot() names what is missing; nothing was persisted"
        )
    return chosen


def persist_snapshot(
    snapshot_id: str | None, directory: str | os.PathLike, *, overwrite: bool = False
) -> CheckpointRecord:
    """Write the snapshot ``snapshot_id`` (``None``: the newest) as the disk checkpoint
    folder ``directory``, which :func:`fsdp_interactive.checkpoint.load` reads (at any
    world size, also after the pool is gone); collective over every rank.

    Each host copies the files it holds (spread over its ranks, checked against their
    checksums on the way); so when ranks span hosts ``directory`` must be on a folder
    every host mounts, as for :func:`fsdp_interactive.checkpoint.save`
    (:class:`CheckpointPathError` otherwise, before anything is copied). The checkpoint
    appears under ``directory`` by one rename once complete; an existing checkpoint there
    is replaced only with ``overwrite=True``. The RNG states are kept under the stateful
    name ``"snapshot_rng"`` (a per-rank :class:`~fsdp_interactive.checkpoint.RNGState`).
    A rank that dies or a host that goes away during the copy leaves a dot-folder next to
    ``directory`` (never listed, removed by the next save there) and the snapshot as it was.
    Private as :func:`~fsdp_interactive.checkpoint.save` makes a checkpoint: folder 0700,
    files 0600, sealed with this user's checkpoint key (refused where another user could
    replace it).
    """
    INFLIGHT.wait()
    ranks = snapshot_ranks()
    located = locate(snapshot_id, ranks)
    chosen = _assignments(located)
    final = Path(directory).absolute()

    def preflight() -> str:
        _checkpoint_folders.check_save_target(final, overwrite)
        _checkpoint_folders.remove_stale_partials(final.parent)
        token = _checkpoint_folders.new_token()
        _checkpoint_folders.make_partial(final, token)
        return token

    partial = _checkpoint_folders.partial_path(final, ranks.run_on_rank0(preflight))
    _check_shared(partial, ranks)
    problems = [
        _copy_checked(located.folder / name, partial / name, located.manifest.files[name])
        for name, rank in chosen.items()
        if rank == ranks.rank
    ]
    found = [p for per in ranks.all_gather([p for p in problems if p]) for p in per]
    if found:
        if ranks.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise SnapshotError(f"persisting snapshot {located.id} failed: " + "; ".join(found))

    def publish() -> CheckpointRecord:
        _store.write_descriptions(partial, located.texts)
        _owner_seal.write_seal(partial, located.texts.manifest, None)
        _checkpoint_folders.publish(partial, final, mode=_checkpoint_folders.DEFAULT_MODE)
        return located.manifest.record(final)

    record = ranks.run_on_rank0(publish)
    logger.info("snapshot %s persisted as %s (%d bytes)", located.id, final, record.size_bytes)
    return record
