"""The JSON manifest that marks a checkpoint folder as complete and describes it.

A published checkpoint folder holds DCP's files (``.metadata``, ``__<rank>_<n>.distcp``)
plus two JSON files written last, by rank 0:

* ``manifest.json``: format version, step, world size at save time, UTC time, whether an
  optimizer is included, the saved Stateful objects (name -> ``"global"`` or
  ``"per_rank"``; absent in checkpoints saved without any), and every data file's size
  and checksum. The checksum algorithm is named under ``"checksum"``: ``"sha256"``
  (disk checkpoints; the default when absent), ``"xxh3_64"`` (XXH3, 64 bits: what
  snapshots write, about 7x cheaper than SHA-256; it catches damage, it is no signature:
  see docs/security.md) or ``"crc32"`` (zlib's CRC-32, which earlier snapshots wrote; read
  only);
* ``extra.json``: the caller's ``extra`` mapping (JSON, never pickle).

A manifest names plain file names of its folder only (no ``/``, no ``..``): any other
entry makes it invalid. Files are checked without following links, and only regular
files pass (a link to ``/dev/zero`` is refused, it does not hang the check). The JSON
files are read without following a link or waiting on a FIFO, and at most
:data:`~fsdp_interactive._private_files.SMALL_FILE_LIMIT` bytes of each
(:func:`read_json_text`). A folder without a readable manifest is not listed as a
checkpoint. Nothing here talks to other ranks.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fsdp_interactive import _private_files
from fsdp_interactive.checkpoint._format._checksums import (
    CHECKSUMS,
    SHA256,
    XXH3_64,
    hash_descriptor,
)
from fsdp_interactive.checkpoint.errors import CheckpointPathError, CorruptCheckpointError

MANIFEST_FILE = "manifest.json"
EXTRA_FILE = "extra.json"
FORMAT = "fsdp-interactive-dcp"
FORMAT_VERSION = 1
#: What snapshots checksum their files with: XXH3 reads ~8 GB/s on one core here (SIMD on
#: any x86-64 or ARM, no special instruction), against ~2-3 GB/s for zlib's CRC-32.
SNAPSHOT_CHECKSUM = XXH3_64


@dataclass(frozen=True)
class FileRecord:
    """One data file of a checkpoint: its byte size and its checksum (hex ``digest`` of
    ``algorithm``, one of :data:`CHECKSUMS`)."""

    size: int
    digest: str
    algorithm: str = SHA256


@dataclass(frozen=True)
class CheckpointRecord:
    """What :func:`~fsdp_interactive.checkpoint.list_checkpoints` reports per checkpoint."""

    path: str
    name: str
    step: int | None
    world_size: int
    created_unix: float
    created_utc: str
    size_bytes: int
    has_optimizer: bool
    num_files: int


@dataclass
class Manifest:
    """The content of ``manifest.json``."""

    step: int | None
    world_size: int
    created_unix: float
    created_utc: str
    has_optimizer: bool
    files: dict[str, FileRecord] = field(default_factory=dict)
    stateful: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @classmethod
    def now(
        cls,
        *,
        step: int | None,
        world_size: int,
        has_optimizer: bool,
        files: dict[str, FileRecord],
        stateful: dict[str, str],
    ) -> Manifest:
        """A manifest stamped with the current time."""
        created = time.time()
        return cls(
            step=step,
            world_size=world_size,
            created_unix=created,
            created_utc=datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="seconds"),
            has_optimizer=has_optimizer,
            files=files,
            stateful=stateful,
        )

    @property
    def checksum(self) -> str:
        """The checksum algorithm of its files (``"sha256"`` when it lists none)."""
        algorithms = {record.algorithm for record in self.files.values()}
        if len(algorithms) > 1:
            raise ValueError(f"one manifest takes one checksum algorithm, got {sorted(algorithms)}")
        return algorithms.pop() if algorithms else SHA256

    def to_json(self) -> str:
        data = asdict(self)
        algorithm = self.checksum
        data["files"] = {
            name: {"size": record.size, algorithm: record.digest}
            for name, record in self.files.items()
        }
        if algorithm != SHA256:  # a disk checkpoint's manifest stays as it always was
            data["checksum"] = algorithm
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: Path) -> Manifest:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"unsupported format_version {data.get('format_version')!r}")
            algorithm = data.get("checksum", SHA256)
            if algorithm not in CHECKSUMS:
                raise ValueError(f"unknown checksum {algorithm!r}, expected one of {CHECKSUMS}")
            unsafe = sorted(
                repr(name) for name in data["files"] if not _private_files.is_plain_name(name)
            )
            if unsafe:
                raise ValueError(
                    f"file names {', '.join(unsafe)} are not plain file names of the folder"
                )
            files = {
                str(name): FileRecord(int(rec["size"]), str(rec[algorithm]), algorithm)
                for name, rec in data["files"].items()
            }
            step = data["step"]
            stateful = {str(k): str(v) for k, v in data.get("stateful", {}).items()}
            return cls(
                step=None if step is None else int(step),
                world_size=int(data["world_size"]),
                created_unix=float(data["created_unix"]),
                created_utc=str(data["created_utc"]),
                has_optimizer=bool(data["has_optimizer"]),
                files=files,
                stateful=stateful,
            )
        except Exception as exc:
            raise CorruptCheckpointError(
                f"{source}: invalid checkpoint manifest ({type(exc).__name__}: {exc})",
                file=str(source),
            ) from exc

    def record(self, folder: Path) -> CheckpointRecord:
        return CheckpointRecord(
            path=str(folder),
            name=folder.name,
            step=self.step,
            world_size=self.world_size,
            created_unix=self.created_unix,
            created_utc=self.created_utc,
            size_bytes=sum(f.size for f in self.files.values()),
            has_optimizer=self.has_optimizer,
            num_files=len(self.files),
        )


def read_json_text(path: Path, what: str) -> str | None:
    """The text of the small file ``path`` (``None`` when it is missing), read as
    :func:`~fsdp_interactive._private_files.read_regular` reads (no link followed, no
    wait on a FIFO, at most ``SMALL_FILE_LIMIT`` bytes); :class:`CorruptCheckpointError`
    naming ``what`` and the file when it cannot be read."""
    try:
        return _private_files.read_regular(path).decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: cannot read {what} ({exc})", file=str(path)) from exc


def read_manifest_text(folder: str | os.PathLike) -> str:
    """The text of ``<folder>/manifest.json`` (:func:`read_json_text`);
    :class:`CorruptCheckpointError` when it is missing or unreadable."""
    path = Path(folder) / MANIFEST_FILE
    text = read_json_text(path, "the manifest")
    if text is None:
        raise CorruptCheckpointError(
            f"{path}: manifest missing: {folder} is not a published checkpoint", file=str(path)
        )
    return text


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """Read ``<folder>/manifest.json``; :class:`CorruptCheckpointError` if absent or bad."""
    return Manifest.from_json(read_manifest_text(folder), Path(folder) / MANIFEST_FILE)


def hash_file(path: Path, algorithm: str = SHA256) -> FileRecord:
    """Size and ``algorithm`` checksum of one regular file (opened without following a
    link; ``OSError`` for anything else)."""
    fd = _private_files.open_regular(path)
    try:
        size, digest = hash_descriptor(fd, algorithm)
    finally:
        os.close(fd)
    return FileRecord(size, digest, algorithm)


def verify_file(
    folder: Path, name: str, expected: FileRecord, *, checksum: bool = True
) -> str | None:
    """Check one file's size (and, with ``checksum``, its checksum, by the record's
    algorithm) against its manifest record; an error message or ``None``. A link or
    anything but a regular file fails."""
    path = folder / name
    try:
        info = path.lstat()
    except FileNotFoundError:
        return f"{path}: file is missing"
    if not stat.S_ISREG(info.st_mode):
        return f"{path}: not a regular file (a link or a device: refused)"
    if info.st_size != expected.size:
        return (
            f"{path}: file is {info.st_size} bytes, the manifest says {expected.size} "
            "(truncated or altered)"
        )
    if checksum:
        try:
            found = hash_file(path, expected.algorithm).digest
        except OSError as exc:
            return f"{path}: cannot read it ({exc})"
        if found != expected.digest:
            return f"{path}: checksum mismatch (file corrupted or altered)"
    return None


def encode_extra(extra: Mapping[str, Any] | None) -> str:
    """Serialize ``extra`` as strict JSON; ``ValueError`` naming the argument otherwise."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping of JSON data, got {type(extra).__name__}")

    def check_numbers(obj: Any, where: str) -> None:
        if isinstance(obj, float) and not math.isfinite(obj):
            raise ValueError(f"extra{where} is {obj!r}: only finite numbers are JSON")
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                check_numbers(v, f"{where}[{k!r}]")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                check_numbers(v, f"{where}[{i}]")

    check_numbers(extra, "")
    try:
        text = json.dumps(dict(extra), indent=2, sort_keys=True, allow_nan=False)
    except TypeError as exc:
        raise TypeError(
            f"extra must hold only JSON data (dict/list/str/int/float/bool/None): {exc}"
        ) from exc
    if len(text.encode("utf-8")) > _private_files.SMALL_FILE_LIMIT:
        raise ValueError(
            f"extra is {len(text.encode('utf-8'))} bytes as JSON; at most "
            f"{_private_files.SMALL_FILE_LIMIT} fit (keep large data in a file of its own)"
        )
    return text


def read_extra(folder: Path, text: str | None = None) -> dict[str, Any]:
    """The ``extra`` mapping saved with a checkpoint (``{}`` if none was saved); ``text``:
    the content of its ``extra.json`` read already (``None``: read here)."""
    path = folder / EXTRA_FILE
    if text is None:
        text = read_json_text(path, "extra data")
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: invalid extra data ({exc})", file=str(path)) from exc
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{path}: extra data is not a JSON object", file=str(path))
    return data


def write_text_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except PermissionError as exc:
        raise CheckpointPathError(f"{path}: no permission to write ({exc})") from exc
