"""One host's snapshot folder: ids, published and unfinished snapshots, listing,
rotation and removal.

Layout of a root (a private folder of this user, see :func:`._place.private_root`)::

    <root>/s000007/                      published: a DCP checkpoint folder (raw format)
        .metadata  __<r>_0.distcp ...    with this host's ranks' files and the ring copies
        manifest.json                    the checkpoint manifest (every file's checksum)
        snapshot.json                    the SnapshotRecord
        seal.json                        both sealed with the pool's key (_snapshot_seal)
    <root>/.s000008.partial-<token>/     being written; never listed

Every folder is made mode 0700 and every file mode 0600, new (``O_EXCL | O_NOFOLLOW``).
A folder is published by one rename once complete on its host, so a rank or host that
dies while a snapshot is written leaves a dot-folder, which the next snapshot into the
root removes, and the previous snapshots whole. A folder is listed, or restored, only
when its seal authenticates its manifest and record under the pool's key. Nothing here
talks to other ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from fsdp_interactive import _private_files
from fsdp_interactive.checkpoint import _checkpoint_folders
from fsdp_interactive.checkpoint._format import _manifest, _snapshot_seal
from fsdp_interactive.checkpoint._format._safe_reader import METADATA_FILE
from fsdp_interactive.checkpoint._format._snapshot_record import SnapshotRecord
from fsdp_interactive.checkpoint._snapshot._place import Hosts, host_name, private_root
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


@dataclass(frozen=True)
class Texts:
    """The three description files of a snapshot folder, as read (``seal``: ``None`` when
    the folder has none)."""

    manifest: str
    record: str
    seal: str | None


def read_texts(folder: Path) -> Texts:
    """The description files of ``folder`` (regular files, no link followed);
    :class:`CorruptCheckpointError` naming a file that cannot be read."""
    found = []
    for name in (_manifest.MANIFEST_FILE, RECORD_FILE, _snapshot_seal.SEAL_FILE):
        try:
            found.append(_private_files.read_regular(folder / name).decode("utf-8"))
        except FileNotFoundError:
            if name != _snapshot_seal.SEAL_FILE:
                raise CorruptCheckpointError(
                    f"{folder / name}: missing: {folder} is not a published snapshot",
                    file=str(folder / name),
                ) from None
            found.append(None)
        except (OSError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(
                f"{folder / name}: cannot read it ({exc})", file=str(folder / name)
            ) from exc
    return Texts(*found)


def unseal(folder: Path, texts: Texts, key: bytes) -> tuple[_manifest.Manifest, SnapshotRecord]:
    """The manifest and record of ``texts`` (read from ``folder``, named by the snapshot's
    id), once their seal holds under ``key``; :class:`CorruptCheckpointError` naming the
    file otherwise (a snapshot this pool did not write, or one altered since)."""
    _snapshot_seal.check(key, folder, texts.manifest, texts.record, texts.seal)
    manifest = _manifest.Manifest.from_json(texts.manifest, folder / _manifest.MANIFEST_FILE)
    record = SnapshotRecord.from_json(texts.record, folder / RECORD_FILE)
    if record.id != folder.name:
        raise CorruptCheckpointError(
            f"{folder / RECORD_FILE}: describes {record.id}, not {folder.name}",
            file=str(folder / RECORD_FILE),
        )
    return manifest, record


def read_folder_record(folder: Path) -> SnapshotRecord:
    """The record of a checkpoint folder a caller names (a snapshot persisted to disk):
    like any disk checkpoint, not authenticated; :class:`CorruptCheckpointError` naming
    the file when it is unreadable or invalid."""
    path = folder / RECORD_FILE
    try:
        text = _private_files.read_regular(path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{path}: cannot read the snapshot record ({exc})", file=str(path)
        ) from exc
    return SnapshotRecord.from_json(text, path)


def complete_here(
    folder: Path, manifest: _manifest.Manifest, record: SnapshotRecord, host: str
) -> bool:
    """Whether ``folder`` holds, at their manifest sizes, every file ``host`` keeps of it
    (sizes only: checksums are read when a snapshot is restored)."""
    kept = Hosts(tuple(record.hosts)).files_kept(host, sorted(manifest.files))
    for name in kept:
        try:
            if (folder / name).lstat().st_size != manifest.files[name].size:
                return False
        except OSError:
            return False
    return METADATA_FILE in manifest.files


def list_snapshots(root: str | os.PathLike | None = None) -> list[SnapshotRecord]:
    """This host's published snapshots that are complete on this host, oldest first.

    Not collective: a plain read of this host's root (``root``, else
    ``$FSDPI_SNAPSHOT_ROOT``, else the default under ``/dev/shm``), any process may call
    it. A root that is not a private folder of this user raises :class:`SnapshotError`
    (nothing in it is trusted). Unfinished snapshots (dot-folders), folders without a
    valid record or manifest, folders whose seal does not hold under the pool's key (not
    written by this pool), and folders that lack a file this host keeps (checked by size)
    are not listed. A snapshot whose files another host kept may be restorable although
    it is not listed here: :func:`restore_snapshot` looks on every host.
    """
    folder = private_root(root, create=False)
    key = None if folder is None else _snapshot_seal.snapshot_key(folder, create=False)
    if folder is None or key is None:
        return []
    host = host_name()
    found = []
    for child in folder.iterdir():
        if id_number(child.name) is None or not child.is_dir() or child.is_symlink():
            continue
        try:
            manifest, record = unseal(child, read_texts(child), key)
        except CheckpointError as exc:
            logger.info("not listed: %s", exc)
            continue
        if complete_here(child, manifest, record, host):
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


def sealed_ids(root: Path, key: bytes) -> list[str]:
    """:func:`published_ids` whose seal holds under ``key``: the snapshots of this pool."""
    found = []
    for name in published_ids(root):
        try:
            unseal(root / name, read_texts(root / name), key)
        except CheckpointError as exc:
            logger.info("not a snapshot of this pool: %s", exc)
            continue
        found.append(name)
    return found


def rotate(root: Path, keep_last: int, protect: str, key: bytes) -> list[str]:
    """Remove all but the newest ``keep_last`` published snapshots of ``root`` (by id) that
    hold the same objects as ``protect`` (:meth:`SnapshotRecord.objects`: a snapshot of
    another model is never dropped for this one), never ``protect``; the ids removed.
    A snapshot whose record cannot be read under ``key`` is left alone."""
    mine = _objects_of(root, protect, key)
    if mine is None:
        return []
    ids = [i for i in published_ids(root) if i == protect or _objects_of(root, i, key) == mine]
    doomed = [i for i in ids[: max(0, len(ids) - keep_last)] if i != protect]
    removed = []
    for name in doomed:
        shutil.rmtree(root / name, ignore_errors=True)
        removed.append(name)
        logger.info("snapshot rotation (keep_last=%d) removed %s", keep_last, root / name)
    return removed


def _objects_of(root: Path, snapshot: str, key: bytes) -> tuple | None:
    try:
        return unseal(root / snapshot, read_texts(root / snapshot), key)[1].objects()
    except CheckpointError as exc:
        logger.info("rotation leaves %s alone: %s", snapshot, exc)
        return None


def remove_leftovers(root: Path) -> list[Path]:
    """Remove the dot-folders of snapshots that did not finish under ``root``."""
    return _checkpoint_folders.remove_stale_partials(root)


def make_folder(path: Path) -> None:
    """Create the private folder ``path`` (mode 0700) in a root; refused when it exists."""
    _private_files.make_private_folder(path, exist_ok=False)


def _write_private(folder: Path, name: str, text: str) -> None:
    """``text`` into ``folder/name`` (mode 0600), written under a new temporary name and
    renamed over ``name``: never through a link, never half written."""
    temporary = folder / f".{name}.{_checkpoint_folders.new_token()}"
    _private_files.write_new_file(temporary, text.encode("utf-8"))
    os.replace(temporary, folder / name)


def write_descriptions(folder: Path, texts: Texts) -> None:
    """Write ``manifest.json``, ``snapshot.json`` and ``seal.json`` into ``folder``
    durably (the last files of a snapshot, before its publishing rename)."""
    assert texts.seal is not None, "a snapshot is never published without its seal"
    _write_private(folder, _manifest.MANIFEST_FILE, texts.manifest)
    _write_private(folder, RECORD_FILE, texts.record)
    _write_private(folder, _snapshot_seal.SEAL_FILE, texts.seal)
    _checkpoint_folders.fsync_dir(folder)


def drop_snapshots(root: str | os.PathLike | None = None) -> list[str]:
    """Remove every snapshot of this host's root, finished or not, then the root if it is
    left empty; the removed paths. Not collective (what a pool's ``stop()`` runs on each
    host).

    Only snapshot folders are removed (published ids and their dot-folders), and the
    root's own key (``.key``, made outside a pool): a root that also holds other files
    keeps them, and is then not removed. A root that is not a private folder of this user
    is left alone (nothing). A background snapshot of this process still being written
    fails (its folder is gone), and says so on its handle.
    """
    try:
        folder = private_root(root, create=False)
    except CheckpointError as exc:
        logger.warning("snapshots not dropped: %s", exc)
        return []
    if folder is None:
        return []
    removed = []
    for child in folder.iterdir():
        ours = id_number(child.name) is not None or _PARTIAL_ID.match(child.name)
        if ours and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(str(child))
    with contextlib.suppress(OSError):
        (folder / _snapshot_seal.KEY_FILE).unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()
    logger.info("dropped %d snapshot folders under %s", len(removed), folder)
    return removed
