"""The JSON manifest that marks a checkpoint folder as complete and describes it.

A published checkpoint folder holds DCP's files (``.metadata``, ``__<rank>_<n>.distcp``)
plus two JSON files written last, by rank 0:

* ``manifest.json``: format version, step, world size at save time, UTC time, whether an
  optimizer is included, the saved Stateful objects (name -> ``"global"`` or
  ``"per_rank"``; absent in checkpoints saved without any), and every data file's size
  and SHA-256;
* ``extra.json``: the caller's ``extra`` mapping (JSON, never pickle).

A folder without a readable manifest is not listed as a checkpoint. Nothing here
talks to other ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fsdp_interactive.checkpoint.errors import CheckpointPathError, CorruptCheckpointError

MANIFEST_FILE = "manifest.json"
EXTRA_FILE = "extra.json"
FORMAT = "fsdp-interactive-dcp"
FORMAT_VERSION = 1
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """One data file of a checkpoint: its byte size and SHA-256 hex digest."""

    size: int
    sha256: str


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

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: Path) -> Manifest:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"unsupported format_version {data.get('format_version')!r}")
            files = {
                str(name): FileRecord(size=int(rec["size"]), sha256=str(rec["sha256"]))
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


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """Read ``<folder>/manifest.json``; :class:`CorruptCheckpointError` if absent or bad."""
    path = Path(folder) / MANIFEST_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path}: manifest missing: {folder} is not a published checkpoint", file=str(path)
        ) from None
    except OSError as exc:
        raise CorruptCheckpointError(
            f"{path}: cannot read manifest ({exc})", file=str(path)
        ) from exc
    return Manifest.from_json(text, path)


def hash_file(path: Path) -> FileRecord:
    """Size and SHA-256 of one file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileRecord(size=size, sha256=digest.hexdigest())


def verify_file(
    folder: Path, name: str, expected: FileRecord, *, checksum: bool = True
) -> str | None:
    """Check one file's size (and, with ``checksum``, its SHA-256) against its manifest
    record; an error message or ``None``."""
    path = folder / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: file is missing"
    if size != expected.size:
        return f"{path}: file is {size} bytes, the manifest says {expected.size} (truncated or altered)"
    if checksum and hash_file(path).sha256 != expected.sha256:
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
        return json.dumps(dict(extra), indent=2, sort_keys=True, allow_nan=False)
    except TypeError as exc:
        raise TypeError(
            f"extra must hold only JSON data (dict/list/str/int/float/bool/None): {exc}"
        ) from exc


def read_extra(folder: Path) -> dict[str, Any]:
    """The ``extra`` mapping saved with a checkpoint (``{}`` if none was saved)."""
    path = folder / EXTRA_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
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
