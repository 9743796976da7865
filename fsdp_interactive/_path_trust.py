"""Whether another local user could change what lies at a path: its folders up to ``/``,
and the files in it.

A folder another user can write into lets them rename, remove or replace what is in it
(a checkpoint moved aside, a planted one put in its place), unless it has the sticky bit
(``/tmp``, ``/dev/shm``: there only an entry's owner may rename or remove it). A folder
another user owns can be made so by them at any time. So a path is *kept from others*
when every existing folder on the way to it, as written and as links resolve it, is owned
by this user or the superuser and is either written by nobody else or sticky; and a file
when it is owned by this user (or the superuser) and nobody else may write it. Group
write counts as another user's (the group may have other members).

Standard library only (and :mod:`fsdp_interactive._private_files`' names for users); the
checkpoints (save, load) and the pool's socket folder use it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fsdp_interactive._private_files import user_name


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def why_folder_open(info: os.stat_result) -> str | None:
    """What lets another user change the entries of a folder with the ``stat`` result
    ``info`` ("is owned by uid 65534 (nobody)", "can be written by other users ...");
    ``None`` when nothing does."""
    if not _trusted_owner(info.st_uid):
        return f"is owned by {user_name(info.st_uid)}"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return (
            f"can be written by other users (mode {stat.S_IMODE(info.st_mode):04o}) and has "
            "no sticky bit"
        )
    return None


def why_file_open(info: os.stat_result) -> str | None:
    """What lets another user change a file (or folder) with the ``lstat`` result
    ``info``; ``None`` when nothing does."""
    if not _trusted_owner(info.st_uid):
        return f"is owned by {user_name(info.st_uid)}"
    if info.st_mode & 0o022:
        return f"can be written by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _existing_ancestors(path: Path) -> list[Path]:
    """Every existing folder ``path`` lies in, from ``/`` down (``path`` itself
    excluded), as written (``path`` made absolute, not resolved)."""
    found = []
    for parent in reversed(Path(os.path.abspath(path)).parents):
        if not os.path.lexists(parent):
            break
        found.append(parent)
    return found


def open_ancestor(path: str | os.PathLike) -> tuple[Path, str] | None:
    """The first existing folder on the way to ``path`` that another user can change,
    with what lets them (:func:`why_folder_open`); ``None`` when there is none.

    Checked as written (each folder's own entry, links not followed: a link's folder is
    checked as one of the folders above it) and as the links resolve it (the folders of
    the real path), so a link that leads through a folder of another user's is found.
    """
    path = Path(path)
    seen: set[Path] = set()
    written = _existing_ancestors(path)
    real = _existing_ancestors(Path(os.path.realpath(written[-1])) / "x") if written else []
    for folder in [*written, *real]:
        if folder in seen:
            continue
        seen.add(folder)
        try:
            info = os.lstat(folder)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            continue  # its folder was checked; where it leads is checked as the real path
        reason = why_folder_open(info)
        if reason is not None:
            return folder, reason
    return None


def open_place(path: str | os.PathLike) -> tuple[Path, str] | None:
    """:func:`open_ancestor`, then ``path`` itself when it exists (its own entry:
    :func:`why_file_open`, no sticky bit excuses it)."""
    found = open_ancestor(path)
    if found is None and os.path.lexists(path):
        reason = why_file_open(os.lstat(path))
        found = (Path(path), reason) if reason else None
    return found
