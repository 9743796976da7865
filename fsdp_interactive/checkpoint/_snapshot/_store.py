"""One host's snapshot folder: ids, published and unfinished snapshots, listing,
rotation and removal.

Layout of a root (see :mod:`._place` for which root)::

    <root>/s000007/                      published: a DCP checkpoint folder with
        .metadata  __<r>_0.distcp ...    this host's ranks' files and the ring copies
        manifest.json                    the checkpoint manifest (every file's checksum)
        snapshot.json                    the SnapshotRecord
    <root>/.s000008.partial-<token>/     being written; never listed

A folder is published by one rename once complete on its host, so a rank or host that
dies while a snapshot is written leaves a dot-folder, which the next snapshot into the
root removes, and the previous snapshots whole. Nothing here talks to other ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

from fsdp_interactive.checkpoint import _layout, _manifest
from fsdp_interactive.checkpoint._safe_reader import METADATA_FILE
from fsdp_interactive.checkpoint._snapshot._place import Hosts, host_name, root_folder
from fsdp_interactive.checkpoint._snapshot._record import SnapshotRecord
from fsdp_interactive.checkpoint.errors import CheckpointError, CorruptCheckpointError

logger = logging.getLogger(__name__)

RECORD_FILE = "snapshot.json"
_ID = re.compile(r"^s(\d{6,})$")
_PARTIAL_ID = re.compile(r"^\.(s\d{6,})\.partial-")


def snapshot_id(number: int) -> str:
    return f"s{number:06d}"


def id_number(name: str) -> int | None:
    """``"s000012"`` -> 12; ``None`` for a name that is not a snapshot id."""
    found = _ID.match(name)
    return int(found.group(1)) if found else None


def highest_number(root: Path) -> int:
    """The highest snapshot number used under ``root`` (published or unfinished), 0 if none."""
    if not root.is_dir():
        return 0
    numbers = [0]
    for child in root.iterdir():
        partial = _PARTIAL_ID.match(child.name)
        number = id_number(partial.group(1) if partial else child.name)
        if number is not None:
            numbers.append(number)
    return max(numbers)


def read_record(folder: Path) -> SnapshotRecord:
    """The record of the snapshot folder ``folder``; :class:`CorruptCheckpointError` naming
    the file when it is missing or invalid."""
    path = folder / RECORD_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CorruptCheckpointError(
            f"{path}: cannot read the snapshot record ({exc})", file=str(path)
        ) from exc
    return SnapshotRecord.from_json(text, path)


def complete_here(folder: Path, record: SnapshotRecord, host: str) -> bool:
    """Whether ``folder`` holds, at their manifest sizes, every file ``host`` keeps of it
    (sizes only: checksums are read when a snapshot is restored)."""
    try:
        manifest = _manifest.read_manifest(folder)
    except CheckpointError:
        return False
    kept = Hosts(tuple(record.hosts)).files_kept(host, sorted(manifest.files))
    for name in kept:
        try:
            if (folder / name).stat().st_size != manifest.files[name].size:
                return False
        except OSError:
            return False
    return METADATA_FILE in manifest.files


def list_snapshots(root: str | os.PathLike | None = None) -> list[SnapshotRecord]:
    """This host's published snapshots that are complete on this host, oldest first.

    Not collective: a plain read of this host's root (``root``, else
    ``$FSDPI_SNAPSHOT_ROOT``, else the default under ``/dev/shm``), any process may call
    it. Unfinished snapshots (dot-folders), folders without a valid record or manifest,
    and folders that lack a file this host keeps (checked by size) are not listed. A
    snapshot whose files another host kept may be restorable although it is not listed
    here: :func:`restore_snapshot` looks on every host.
    """
    folder = root_folder(root)
    if not folder.is_dir():
        return []
    host = host_name()
    found = []
    for child in folder.iterdir():
        if id_number(child.name) is None or not child.is_dir():
            continue
        try:
            record = read_record(child)
        except CheckpointError:
            continue
        if record.id == child.name and complete_here(child, record, host):
            found.append(record)
    return sorted(found, key=lambda r: id_number(r.id) or 0)


def published_ids(root: Path) -> list[str]:
    """Ids of the published snapshot folders under ``root`` (with a record file), oldest first."""
    if not root.is_dir():
        return []
    ids = [
        c.name
        for c in root.iterdir()
        if id_number(c.name) is not None and (c / RECORD_FILE).is_file()
    ]
    return sorted(ids, key=lambda name: id_number(name) or 0)


def rotate(root: Path, keep_last: int, protect: str) -> list[str]:
    """Remove all but the newest ``keep_last`` published snapshots of ``root`` (by id),
    never ``protect``; the removed folders."""
    ids = published_ids(root)
    doomed = [i for i in ids[: max(0, len(ids) - keep_last)] if i != protect]
    removed = []
    for name in doomed:
        shutil.rmtree(root / name, ignore_errors=True)
        removed.append(str(root / name))
        logger.info("snapshot rotation (keep_last=%d) removed %s", keep_last, root / name)
    return removed


def remove_leftovers(root: Path) -> list[Path]:
    """Remove the dot-folders of snapshots that did not finish under ``root``."""
    return _layout.remove_stale_partials(root)


def write_descriptions(folder: Path, manifest_json: str, record_json: str) -> None:
    """Write ``manifest.json`` and ``snapshot.json`` into ``folder`` durably (the last
    files of a snapshot, before its publishing rename)."""
    _manifest.write_text_durably(folder / _manifest.MANIFEST_FILE, manifest_json)
    _manifest.write_text_durably(folder / RECORD_FILE, record_json)
    _layout.fsync_dir(folder)


def drop_snapshots(root: str | os.PathLike | None = None) -> list[str]:
    """Remove every snapshot of this host's root, finished or not, then the root if it is
    left empty; the removed paths. Not collective (what a pool's ``stop()`` runs on each
    host).

    Only snapshot folders are removed (published ids and their dot-folders): a root that
    also holds other files keeps them, and is then not removed. A background snapshot of
    this process still being written fails (its folder is gone), and says so on its handle.
    """
    folder = root_folder(root)
    if not folder.is_dir():
        return []
    removed = []
    for child in folder.iterdir():
        ours = id_number(child.name) is not None or _PARTIAL_ID.match(child.name)
        if ours and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(str(child))
    with contextlib.suppress(OSError):
        folder.rmdir()
    logger.info("dropped %d snapshot folders under %s", len(removed), folder)
    return removed
