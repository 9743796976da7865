"""The seal of a disk checkpoint: its manifest and ``extra`` authenticated with the key of
the user who saved it, so that a checkpoint planted by someone else is refused.

The manifest holds every file's size and SHA-256, and ``.metadata`` among the files, so
anyone who can write a folder can also write a manifest whose checksums match their own
data. What they cannot write is ``owner-seal.json``: an HMAC-SHA256 of ``manifest.json``
and of ``extra.json`` (or of its absence) under this user's checkpoint key
(:mod:`fsdp_interactive.checkpoint._format._owner_key`, kept where only the user reaches). Every
save and every persisted snapshot writes one; every load checks it before anything else is read
(the DCP metadata is unpickled, with the allow-list, only after it holds).

Not bound to the folder's name or place: a user may move, copy or rename their
checkpoints. A checkpoint of another user (or one saved before checkpoints were sealed)
is refused until its user says it is theirs: ``load(..., trusted=True)`` once, or
:func:`trust` (its files are checked against its manifest, then it is sealed with this
user's key). Nothing here talks to other ranks.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from fsdp_interactive.checkpoint._format import _manifest, _owner_key, _seal_json
from fsdp_interactive.checkpoint.errors import CheckpointError, UntrustedCheckpointError

SEAL_FILE = "owner-seal.json"
SEALED = ("manifest.json", "extra.json")
_FORMAT = "fsdp-interactive-checkpoint-seal"
_LABEL = b"fsdp-interactive checkpoint\x00"
#: What to do with a checkpoint the seal refuses.
TRUST_HINT = (
    "if it is yours (saved by you before checkpoints were sealed, or under another key), "
    "load it once with trusted=True, or seal it with fsdp_interactive.checkpoint.trust(path)"
)


def _mac(key: bytes, name: str, text: str | None) -> str:
    body = b"\x00absent" if text is None else b"\x01" + text.encode("utf-8")
    return hmac.new(key, _LABEL + name.encode() + b"\x00" + body, hashlib.sha256).hexdigest()


def seal_text(key: bytes, manifest_json: str, extra_json: str | None) -> str:
    """The content of ``owner-seal.json`` for a checkpoint's manifest and extra texts
    (``None``: it has no ``extra.json``)."""
    texts = dict(zip(SEALED, (manifest_json, extra_json), strict=True))
    macs = {name: _mac(key, name, text) for name, text in texts.items()}
    return _seal_json.write(_FORMAT, macs, key=_owner_key.fingerprint(key))


def write_seal(
    folder: Path, manifest_json: str, extra_json: str | None, *, name: str = SEAL_FILE
) -> None:
    """Write ``folder``'s seal (durably, as ``name``) for the manifest and extra texts
    written there, under this user's checkpoint key; :class:`CheckpointError` when the key
    cannot be had (the message says what to do)."""
    try:
        key = _owner_key.owner_key()
    except _owner_key.OwnerKeyError as exc:
        raise CheckpointError(f"cannot seal the checkpoint {folder}: {exc}") from None
    _manifest.write_text_durably(folder / name, seal_text(key, manifest_json, extra_json))


def check(
    key: bytes,
    folder: Path,
    manifest_json: str,
    extra_json: str | None,
    seal_json: str | None,
) -> None:
    """Raise :class:`UntrustedCheckpointError` naming the file unless ``seal_json`` (the
    content of ``folder``'s seal; ``None``: there is none) authenticates its manifest and
    extra texts under ``key``."""
    where = folder / SEAL_FILE
    if seal_json is None:
        raise UntrustedCheckpointError(
            f"{where}: missing: {folder} was not saved by this user (no seal: another user's, "
            f"an older version's, or planted); refusing it; {TRUST_HINT}",
            file=str(where),
        )
    try:
        macs, data = _seal_json.read(seal_json, _FORMAT, SEALED)
    except ValueError as exc:
        raise UntrustedCheckpointError(
            f"{where}: invalid seal ({exc}); refusing {folder}; {TRUST_HINT}", file=str(where)
        ) from None
    if data.get("key") != _owner_key.fingerprint(key):
        raise UntrustedCheckpointError(
            f"{where}: sealed with another key than this user's checkpoint key: another "
            f"user's checkpoint, or yours under a key since replaced; refusing {folder}; "
            f"{TRUST_HINT}",
            file=str(where),
        )
    texts = dict(zip(SEALED, (manifest_json, extra_json), strict=True))
    for name, text in texts.items():
        if not hmac.compare_digest(macs[name], _mac(key, name, text)):
            raise UntrustedCheckpointError(
                f"{folder / name}: altered since it was saved, or not saved by this user (its "
                f"seal does not match); refusing {folder}",
                file=str(folder / name),
            )
