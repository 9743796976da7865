"""Where checkpoints live on disk: temporary names, publishing, listing and rotation.

A checkpoint ``<root>/<name>`` is written as ``<root>/.<name>.partial-<token>`` and
renamed to ``<root>/<name>`` (one ``os.rename``, atomic on POSIX file systems) only
after every rank's data, the DCP metadata and the manifest are on disk. Listing ignores
dot-names, so a save that crashed mid-way is never listed; the next save into the same
root removes such leftovers. Overwriting moves the old folder aside first
(``.<name>.replaced-<token>``); if a crash lands between the two renames, the next save
into the root puts the old folder back. One writer per root folder is assumed.

Nothing here talks to other ranks; callers decide which rank runs what.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from fsdp_interactive import _path_trust
from fsdp_interactive.checkpoint._format._manifest import CheckpointRecord, read_manifest
from fsdp_interactive.checkpoint.errors import CheckpointError, CheckpointPathError

logger = logging.getLogger(__name__)

_PARTIAL_MARK = ".partial-"
_REPLACED_MARK = ".replaced-"
#: The mode of a checkpoint's folder unless a save asks for another (its files: 0600).
DEFAULT_MODE = 0o700


def check_mode(mode: object) -> int:
    """``mode`` as a checkpoint folder's mode; ``ValueError`` naming the argument unless it
    is permission bits (at most ``0o777``) that give the owner ``rwx``."""
    if (
        isinstance(mode, bool)
        or not isinstance(mode, int)
        or mode & ~0o777
        or mode & 0o700 != 0o700
    ):
        raise ValueError(
            f"mode must be a folder mode such as 0o700 (the default: only you) or 0o750 (your "
            f"group may read), permission bits with rwx for the owner; got {mode!r}"
        )
    return mode


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def partial_path(final: Path, token: str) -> Path:
    """The temporary folder a save into ``final`` writes to."""
    return final.parent / f".{final.name}{_PARTIAL_MARK}{token}"


def is_partial(path: Path) -> bool:
    return path.name.startswith(".") and _PARTIAL_MARK in path.name


def check_save_target(final: Path, overwrite: bool, mode: int = DEFAULT_MODE) -> None:
    """Raise :class:`CheckpointPathError` if a checkpoint cannot be saved at ``final``;
    make the missing folders above it (mode ``mode``)."""
    if final.name in {"", ".", ".."} or final.name.startswith("."):
        raise CheckpointPathError(
            f"path {str(final)!r}: the checkpoint folder name must not be empty or start with '.'"
        )
    refuse_open_target(final)
    if final.exists() and not final.is_dir():
        raise CheckpointPathError(
            f"path {str(final)!r} is a file; expected a checkpoint folder (new or existing)"
        )
    if final.is_dir():
        if not overwrite:
            raise CheckpointPathError(
                f"path {str(final)!r} already exists; pass overwrite=True to replace it"
            )
        if any(final.iterdir()) and not (final / "manifest.json").exists():
            raise CheckpointPathError(
                f"path {str(final)!r} is a non-empty folder that is not a checkpoint; "
                "refusing to replace it"
            )
    root = final.parent
    if root.exists() and not root.is_dir():
        raise CheckpointPathError(f"parent {str(root)!r} of the checkpoint path is a file")
    try:
        make_folders(root, mode)
    except PermissionError as exc:
        raise CheckpointPathError(f"cannot create folder {str(root)!r}: no permission") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointPathError(f"folder {str(root)!r} is not writable (no permission)")


def refuse_open_target(final: Path) -> None:
    """:class:`CheckpointPathError` naming the folder and what to do when another user
    could replace what a save publishes at ``final`` (see the module)."""
    found = _path_trust.open_place(final)
    if found is None:
        return
    folder, reason = found
    if reason.startswith("is owned by"):
        advice = "save under a folder of your own"
    else:
        advice = (
            f"make it writable by you alone (chmod go-w {folder}), give it the sticky bit "
            f"(chmod +t {folder}), or save under a folder of your own"
        )
    raise CheckpointPathError(
        f"refusing to save {final}: the folder {folder} {reason}, so another user could move "
        f"the checkpoint aside and put their own in its place; {advice}"
    )


def make_folders(folder: Path, mode: int) -> None:
    """Make ``folder`` and the missing folders above it, each with exactly ``mode``."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=mode)
        except FileExistsError:
            continue  # another process made it meanwhile: it keeps its own mode
        os.chmod(path, mode)  # the umask took bits away


def make_partial(final: Path, token: str) -> Path:
    """The temporary folder of a save into ``final`` (:func:`partial_path`), made with mode
    0700 whatever the umask (a name that exists is an error)."""
    partial = partial_path(final, token)
    partial.mkdir(mode=0o700)
    os.chmod(partial, 0o700)
    return partial


def set_modes(folder: Path, mode: int) -> None:
    """Give ``folder`` ``mode`` and every regular file in it ``mode & 0o666`` (links and
    other entries are left alone)."""
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, mode & 0o666, follow_symlinks=False)
    os.chmod(folder, mode)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(partial: Path, final: Path, *, mode: int | None = None) -> None:
    """Rename the finished ``partial`` folder to ``final`` (replacing an old checkpoint);
    with ``mode``, the folder and its files get their modes first (:func:`set_modes`)."""
    if mode is not None:
        set_modes(partial, mode)
    trash = None
    if final.exists():
        trash = final.parent / f".{final.name}{_REPLACED_MARK}{new_token()}"
        os.rename(final, trash)
    try:
        os.rename(partial, final)
    except OSError as exc:
        if trash is not None:
            os.rename(trash, final)
        raise CheckpointError(f"could not publish {partial} as {final}: {exc}") from exc
    fsync_dir(final.parent)
    logger.info("published %s (renamed from %s)", final, partial.name)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
        logger.info("replaced the previous checkpoint at %s", final)


def remove_stale_partials(root: Path, keep: set[Path] | None = None) -> list[Path]:
    """Delete leftovers of crashed saves in ``root`` (except the folders in ``keep``)."""
    removed = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if not child.is_dir() or (keep and child in keep):
            continue
        if child.name.startswith(".") and _REPLACED_MARK in child.name:
            # A crash between the two renames of an overwrite: put the old one back.
            original = root / child.name[1:].split(_REPLACED_MARK)[0]
            if not original.exists():
                os.rename(child, original)
                logger.info("restored %s from an interrupted overwrite", original)
                continue
        if is_partial(child) or (child.name.startswith(".") and _REPLACED_MARK in child.name):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
            logger.info("removed %s, left by a save that did not finish", child)
    return removed


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointRecord]:
    """Published checkpoints in ``root``, oldest first (by step, then creation time).

    Unfinished saves (dot-named partial folders) and folders without a valid manifest are
    not listed. A missing ``root`` lists nothing; a ``root`` that is a file is an error.
    """
    root_path = Path(root)
    if root_path.exists() and not root_path.is_dir():
        raise CheckpointPathError(f"{str(root_path)!r} is a file; expected a checkpoint folder")
    if not root_path.exists():
        return []
    records = []
    for child in root_path.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            records.append(read_manifest(child).record(child))
        except CheckpointError:
            continue
    return sorted(records, key=_age_key)


def _age_key(record: CheckpointRecord) -> tuple[int, float, str]:
    return (-1 if record.step is None else record.step, record.created_unix, record.name)


def latest_checkpoint(root: str | os.PathLike) -> CheckpointRecord | None:
    """The newest published checkpoint in ``root`` (highest step, then newest), or None."""
    records = list_checkpoints(root)
    return records[-1] if records else None


def rotate(root: Path, keep_last: int, protect: Path) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints of ``root``; never ``protect``."""
    records = list_checkpoints(root)
    doomed = [r for r in records[: max(0, len(records) - keep_last)] if Path(r.path) != protect]
    for record in doomed:
        shutil.rmtree(record.path, ignore_errors=True)
        logger.info("rotation (keep_last=%d) removed %s", keep_last, record.path)
    return [r.path for r in doomed]
