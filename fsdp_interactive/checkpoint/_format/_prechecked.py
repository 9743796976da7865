"""Checksums of a snapshot's files taken ahead of a restore, and whether they still hold.

A restore checks every file of the snapshot against its manifest before it loads a byte
(about 0.2 s per GB per core here, on the recovery's critical path). During a recovery the
host's CPUs idle for about a second while the new group starts; the host's engine forker
(which outlives the ranks) uses it: :func:`precheck` (in a child of the forker) hashes the
files of the snapshot the recovery will restore and records, in the snapshot's folder
(:data:`RECORD_FILE`), each file's checksum with the file's identity and times
(:class:`Stamp`). When the restore checks the files, :func:`prechecked` gives it the
checksums whose files still carry the recorded stamp; it hashes only the others.

When a recorded checksum is trusted: the file is the same inode of the same device, of the
same size, with the same modification and change times (nanoseconds) as when it was
hashed, the stamp did not move while it was hashed, and its change time was at least
:data:`SETTLED_S` older than the hashing (file times come from a coarse clock, so a write
in the same tick as the hashing could leave them as they were). Writing to a file, or
replacing it, moves its change time, which no user can set back. Only a write through a
shared writable mapping of the file may leave it as it was; nothing of the package maps
snapshot files. A checksum that differs from the manifest's is never trusted either way:
that file is hashed again by the restore (and refused or repaired as it would be without
a record).

The record is a private file (mode 0600) in the snapshot's private folder, written under
a temporary name and renamed into place, so it is whole or absent; it is read without
following a link and only when it is a regular file of this user. A precheck that dies
leaves no record (the restore then hashes everything); a missing, unreadable or damaged
record, or one of another snapshot, is ignored the same way. The record goes with the
folder when the snapshot is dropped or rotated away.

Standard library only (and the package's leaves), without torch: the forker's child
imports nothing more to do this.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fsdp_interactive import _private_files
from fsdp_interactive.checkpoint._format._checksums import CHECKSUMS, SHA256, hash_descriptor

logger = logging.getLogger(__name__)

#: The record's name in a snapshot folder (a dot-file: never taken for a data file).
RECORD_FILE = ".prechecked.json"
#: A file changed less than this many seconds before it is hashed is not recorded. File
#: times come from the kernel's coarse clock, which moves once a tick (1 to 10 ms): a
#: write in the tick of the file's last change could leave its times as they were, but
#: not one made a tick later. (Kernels with multigrain timestamps, 6.13 and later, give
#: a change after a ``stat`` a new time anyway.) Ten of the longest ticks.
SETTLED_S = 0.1
_MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Stamp:
    """What identifies one version of a file: device, inode, size, modification and
    change times (ns)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> Stamp:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


@dataclass(frozen=True)
class Prechecked:
    """One file's checksum as :func:`precheck` found it: ``algorithm`` (one of
    :data:`~fsdp_interactive.checkpoint._format._checksums.CHECKSUMS`), hex ``digest``, and the
    file's ``stamp`` when it was hashed."""

    algorithm: str
    digest: str
    stamp: Stamp


def _manifest_checksums(folder: Path) -> dict[str, str]:
    """Each file the folder's manifest lists, with the algorithm it is checked with.

    Read only to know what to hash: the digests are compared with the sealed manifest by
    the restore, never here."""
    data = json.loads(_private_files.read_regular(folder / _MANIFEST_FILE))
    default = data.get("checksum", SHA256)
    return {name: default for name in data.get("files", {}) if _private_files.is_plain_name(name)}


def is_snapshot_name(name: object) -> bool:
    """Whether ``name`` can name a published snapshot folder of a root (a plain name, not
    a dot-folder): what a precheck accepts."""
    return _private_files.is_plain_name(name) and not str(name).startswith(".")


def _hash_settled(folder_fd: int, name: str, algorithm: str) -> Prechecked | None:
    """The checksum of the file ``name`` when it is a regular file that settled before and
    did not change while it was hashed; else ``None``."""
    started = time.time_ns()
    try:
        fd = _private_files.open_regular(name, dir_fd=folder_fd)
    except OSError:
        return None
    try:
        before = os.fstat(fd)
        if before.st_ctime_ns > started - int(SETTLED_S * 1e9):
            return None
        size, digest = hash_descriptor(fd, algorithm)
        after = Stamp.of(os.fstat(fd))
    finally:
        os.close(fd)
    if after != Stamp.of(before) or size != after.size:
        return None
    return Prechecked(algorithm, digest, after)


def precheck(folder: str | os.PathLike) -> int:
    """Hash every file the snapshot folder ``folder``'s manifest lists that this host
    holds, and record the checksums in :data:`RECORD_FILE` (replacing an older record);
    the number of files recorded. ``OSError`` / ``ValueError`` when the folder is not a
    private folder of this user or has no readable manifest (nothing is written then)."""
    folder = Path(folder)
    folder_fd = _private_files.open_folder(folder)
    try:
        names = _manifest_checksums(folder)
        found = {}
        for name, algorithm in sorted(names.items()):
            if algorithm in CHECKSUMS:
                checked = _hash_settled(folder_fd, name, algorithm)
                if checked is not None:
                    found[name] = asdict(checked)
        text = json.dumps({"files": found}, sort_keys=True).encode()
        temporary = f".{RECORD_FILE}.{os.getpid()}.{time.monotonic_ns()}"
        fd = _private_files.create_file(temporary, folder_fd=folder_fd)
        try:
            view = memoryview(text)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.rename(temporary, RECORD_FILE, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    finally:
        os.close(folder_fd)
    return len(found)


def _read_record(folder: Path) -> dict[str, Prechecked]:
    fd = _private_files.open_regular(folder / RECORD_FILE, max_size=_private_files.SMALL_FILE_LIMIT)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = json.loads(f.read(_private_files.SMALL_FILE_LIMIT + 1))
    finally:
        os.close(fd)
    return {
        name: Prechecked(entry["algorithm"], entry["digest"], Stamp(**entry["stamp"]))
        for name, entry in data["files"].items()
        if _private_files.is_plain_name(name)
    }


def prechecked(folder: str | os.PathLike) -> dict[str, Prechecked]:
    """The recorded checksums of ``folder``'s files that still hold: each file still
    carries the stamp it had when it was hashed (``{}`` without a usable record)."""
    folder = Path(folder)
    try:
        recorded = _read_record(folder)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.info("%s: ignoring the precheck record (%s: %s)", folder, type(exc).__name__, exc)
        return {}
    holding = {}
    for name, entry in recorded.items():
        try:
            info = os.lstat(folder / name)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and Stamp.of(info) == entry.stamp:
            holding[name] = entry
    return holding
