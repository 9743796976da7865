"""``trust``: a checkpoint the user vouches for, sealed with their own checkpoint key.

What :func:`~fsdp_interactive.checkpoint.load` refuses as not the user's (no seal: one
saved before checkpoints were sealed; another key: saved under a key since replaced, or a
colleague's checkpoint copied into the user's folder) loads without ``trusted=True``
once it is sealed again: every file is checked against its manifest first (sizes and
checksums), then ``owner-seal.json`` is written under this user's key. In one process,
without a process group.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint._format import _manifest, _owner_seal
from fsdp_interactive.checkpoint._format._manifest import CheckpointRecord
from fsdp_interactive.checkpoint._load import check_folder, open_entry, verify_files
from fsdp_interactive.checkpoint.errors import CheckpointPathError


def trust(path: str | os.PathLike) -> CheckpointRecord:
    """Seal the checkpoint folder ``path`` with this user's checkpoint key, once each of its
    files matches its manifest; its record.

    Refused (:class:`CheckpointPathError`) where another user could change it (a folder on
    the way to it, it or a file in it, owned by another user or writable by one): copy it
    into a folder of your own first. :class:`CorruptCheckpointError` names a file that does not
    match. Read as a load reads: no link followed, no wait on a FIFO, sizes bounded.
    """
    folder = Path(path).absolute()
    found = open_entry(folder) if folder.is_dir() else None
    if found is not None:
        where, reason = found
        raise CheckpointPathError(
            f"refusing to seal {folder}: {where} {reason}, so another user could change it "
            "after it is sealed; copy the checkpoint into a folder of your own, then trust "
            "the copy"
        )
    manifest, metadata, _ = check_folder(folder, trusted=True)
    verify_files(folder, manifest, metadata, Ranks(local=True), checksum=True)
    manifest_json = _manifest.read_manifest_text(folder)
    extra_json = _manifest.read_json_text(folder / _manifest.EXTRA_FILE, "extra data")
    temporary = f".{_owner_seal.SEAL_FILE}.partial"
    _owner_seal.write_seal(folder, manifest_json, extra_json, name=temporary)
    os.replace(folder / temporary, folder / _owner_seal.SEAL_FILE)
    return manifest.record(folder)
