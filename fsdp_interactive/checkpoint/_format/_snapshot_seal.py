"""The seal of a snapshot: its description authenticated with the key of the pool that
wrote it, so that a snapshot this pool did not write is never restored.

Every published snapshot folder holds ``seal.json`` beside ``manifest.json`` and
``snapshot.json``: an HMAC-SHA256 of each of the two, under the snapshot key, bound to
the snapshot's id and the file's name. The manifest holds every data file's size and
checksum, so the seal covers the data through it: a file that does not match its
manifest entry fails the manifest's check, a manifest or record that was changed, moved
to another id, or written without the key fails the seal (named in the error).

The key (:func:`snapshot_key`) is ``$FSDPI_SNAPSHOT_KEY`` (hex): a pool sets one, made once
per ``Pool``, in every rank's environment, so that every host and every later group of
the pool (a recovery's) holds the same key. Outside a pool it is the snapshot root's own
key, kept in the root's ``.key`` file (made private, once, by the first rank to need it):
then ranks on several hosts must be given the same ``$FSDPI_SNAPSHOT_KEY`` (a snapshot
refuses when their keys differ, :func:`fingerprint`).

Nothing here talks to other ranks.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from fsdp_interactive import _private_files
from fsdp_interactive.checkpoint._format import _seal_json
from fsdp_interactive.checkpoint.errors import CorruptCheckpointError, SnapshotError

KEY_ENV = "FSDPI_SNAPSHOT_KEY"
KEY_FILE = ".key"
SEAL_FILE = "seal.json"
#: The files a seal covers, by name.
SEALED = ("manifest.json", "snapshot.json")
_FORMAT = "fsdp-interactive-snapshot-seal"
_LABEL = b"fsdp-interactive snapshot\x00"


def _root_key(root: Path, create: bool) -> bytes | None:
    """The key kept in the private folder ``root`` (made there on first use with
    ``create``: :func:`~fsdp_interactive._private_files.key_file`; ``None`` when there is
    none and not ``create``)."""
    path = root / KEY_FILE
    if not create and not os.path.lexists(path):
        return None
    try:
        return bytes.fromhex(_private_files.key_file(root, KEY_FILE).decode())
    except ValueError:
        raise SnapshotError(
            f"{path}: not a snapshot key (hex digits); remove it (its snapshots cannot be "
            "restored without it)"
        ) from None


def snapshot_key(root: Path, *, create: bool = True) -> bytes | None:
    """The key snapshots under the private folder ``root`` are sealed with (see the
    module; ``None`` when the root keeps none and not ``create``: no snapshot there can
    be authentic); :class:`SnapshotError` naming the variable when it is not hex."""
    text = os.environ.get(KEY_ENV)
    if not text:
        return _root_key(root, create)
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise SnapshotError(f"${KEY_ENV} must be a key in hex digits (a pool sets it)") from None


def fingerprint(key: bytes) -> str:
    """A short value that tells whether two ranks hold the same key, without showing it."""
    return hmac.new(key, _LABEL + b"fingerprint", hashlib.sha256).hexdigest()[:16]


def _mac(key: bytes, snapshot_id: str, name: str, text: str) -> str:
    message = _LABEL + f"{snapshot_id}\x00{name}\x00".encode() + text.encode("utf-8")
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def seal(key: bytes, snapshot_id: str, manifest_json: str, record_json: str) -> str:
    """The content of ``seal.json`` for a snapshot's manifest and record texts."""
    texts = dict(zip(SEALED, (manifest_json, record_json), strict=True))
    return _seal_json.write(
        _FORMAT, {name: _mac(key, snapshot_id, name, text) for name, text in texts.items()}
    )


def check(
    key: bytes,
    folder: Path,
    manifest_json: str,
    record_json: str,
    seal_json: str | None,
) -> None:
    """Raise :class:`CorruptCheckpointError` naming the file unless ``seal_json`` (the
    content of ``folder``'s seal; ``None``: there is none) authenticates the texts of
    ``folder``'s manifest and record under ``key``; the snapshot's id is the folder's
    name."""
    where = folder / SEAL_FILE
    if seal_json is None:
        raise CorruptCheckpointError(
            f"{where}: missing: {folder.name} was not written by this pool (no seal); refusing it",
            file=str(where),
        )
    try:
        macs, _ = _seal_json.read(seal_json, _FORMAT, SEALED)
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"{where}: invalid seal ({exc}); refusing it", file=str(where)
        ) from None
    texts = dict(zip(SEALED, (manifest_json, record_json), strict=True))
    for name, text in texts.items():
        if not hmac.compare_digest(macs[name], _mac(key, folder.name, name, text)):
            raise CorruptCheckpointError(
                f"{folder / name}: not written by this pool, or altered since (its seal "
                "does not match this pool's key); refusing the snapshot",
                file=str(folder / name),
            )
