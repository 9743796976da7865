"""Folders and files only this user can reach, made where nobody else could have made them
first, never through a link someone else placed.

What a pool keeps in shared places (snapshots under ``/dev/shm``, the rendezvous file) lives
in a *private folder*: a real folder (not a symbolic link) owned by this process's
effective user, mode ``0700``. Such a folder can only have been made by this user (or the
superuser): another user can neither create it first with other rights, nor enter it,
list it, or rename, replace or add anything inside. What is made inside is private too:
folders ``0700``, files ``0600`` created with ``O_EXCL | O_NOFOLLOW`` (a name that exists
already, a link included, is refused instead of written through). Files read back are
opened with ``O_NOFOLLOW | O_NONBLOCK``, must be regular files by ``fstat`` before a byte
is read, and are read with a bound on their size: a link to ``/dev/zero`` or a FIFO put
in place of a file is refused at once, it neither hangs a reader nor fills its memory.

Standard library only, importing nothing of the package: the engine forker and the orphan
reaper use it in processes that must start fast, the ranks' snapshot code on every host.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import stat

#: Mode of every private folder, and of every file made in one.
FOLDER_MODE = 0o700
FILE_MODE = 0o600
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, before the
# fstat that refuses it could run (for a regular file the flag changes nothing).
_READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: The most a small file read back whole (a manifest, a record, a seal, a key) may hold.
SMALL_FILE_LIMIT = 16 << 20


class NotPrivateError(PermissionError):
    """A path that is not (or cannot become) a private folder or file of this user.

    ``path`` is the path, ``reason`` what is wrong with it ("is owned by uid 1000 ...").
    A ``PermissionError`` (an ``OSError``), so that callers handling file-system errors
    handle it too.
    """

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"{self.path} {reason}")


def user_name(uid: int) -> str:
    """``uid 65534 (nobody)``: the user ``uid`` as messages name it."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a plain file name of a folder: not empty, no ``/``, not ``.`` or
    ``..``, no NUL (a manifest entry ``../../dev/zero`` is not one)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def why_not_private(info: os.stat_result) -> str | None:
    """What keeps a folder with the ``lstat`` result ``info`` from being a private folder of
    this user; ``None`` when it is one."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != os.geteuid():
        return f"is owned by {user_name(info.st_uid)}, not by this user ({user_name(os.geteuid())})"
    if info.st_mode & 0o077:
        return (
            f"has mode {stat.S_IMODE(info.st_mode):04o}: other users can reach it "
            f"(a private folder has mode {FOLDER_MODE:04o})"
        )
    return None


def check_private_folder(path: str | os.PathLike) -> None:
    """Raise :class:`NotPrivateError` unless ``path`` is a private folder of this user (a
    missing one raises ``FileNotFoundError``). The path itself is looked at, never what a
    link points to."""
    reason = why_not_private(os.lstat(path))
    if reason is not None:
        raise NotPrivateError(path, reason)


def make_private_folder(path: str | os.PathLike, *, exist_ok: bool) -> bool:
    """Create the private folder ``path``; whether it was created here.

    Its parent must exist. A path that exists already is refused
    (:class:`NotPrivateError`), unless ``exist_ok`` and it is a private folder of this
    user, which is then used as it is (``False`` is returned).
    """
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileExistsError:
        if not exist_ok:
            raise NotPrivateError(
                path, "exists already: it was made by someone else, or left by an earlier run"
            ) from None
        check_private_folder(path)
        return False
    # The umask can only take bits away: the folder has mode 0700 or less; make it 0700.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, FOLDER_MODE)
    finally:
        os.close(fd)
    check_private_folder(path)
    return True


def open_folder(path: str | os.PathLike) -> int:
    """A descriptor of the private folder ``path`` (opened without following a link, then
    checked), for creating files in it by name (:func:`create_file`)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        reason = why_not_private(os.fstat(fd))
        if reason is not None:
            raise NotPrivateError(path, reason)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_file(name: str | os.PathLike, *, folder_fd: int | None = None) -> int:
    """A new file, mode ``0600``, opened for writing; its descriptor. ``name`` is a path,
    or with ``folder_fd`` a name in that folder. Refused (``FileExistsError``) when the
    name exists, a link included: nothing is ever written through a link."""
    return os.open(name, _NEW_FILE, FILE_MODE, dir_fd=folder_fd)


def open_log(path: str | os.PathLike) -> int:
    """``path`` opened for appending (a log), made mode ``0600`` when it is new; a link is
    refused, never written through (``OSError``). Its descriptor."""
    return os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE
    )


def write_new_file(path: str | os.PathLike, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` into the new file ``path`` (:func:`create_file`), fsynced with
    ``sync``."""
    fd = create_file(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def open_regular(
    path: str | os.PathLike, *, dir_fd: int | None = None, max_size: int | None = None
) -> int:
    """``path`` (with ``dir_fd``: a name in that folder) opened for reading without
    following a link and without waiting (a FIFO opens at once); ``OSError`` naming the
    path unless ``fstat`` finds a regular file (a device, a FIFO, a folder or a link is
    refused: nothing blocks or reads on without end), or when it holds more than
    ``max_size`` bytes."""
    fd = os.open(path, _READ_FILE, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{os.fspath(path)} is not a regular file ({_kind(info.st_mode)})")
        if max_size is not None and info.st_size > max_size:
            raise OSError(
                f"{os.fspath(path)} holds {info.st_size} bytes, more than the {max_size} "
                "such a file may hold"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_regular(path: str | os.PathLike, *, limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The content of the regular file ``path`` (:func:`open_regular`), at most ``limit``
    bytes: a file that holds more, or grows past it while read, raises ``OSError``."""
    fd = open_regular(path, max_size=limit)
    try:
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise OSError(f"{os.fspath(path)} holds more than the {limit} bytes it may hold")
        return b"".join(chunks)
    finally:
        os.close(fd)


def key_file(folder: str | os.PathLike, name: str) -> bytes:
    """The secret kept in the file ``name`` of the private folder ``folder``: its text (hex
    digits, as written), made there on first use: 32 random bytes, in a new file of mode
    ``0600`` made with ``O_EXCL | O_NOFOLLOW`` under a temporary name and linked to
    ``name``, so that a reader finds it whole and, of two processes making one at once,
    the first link wins. ``NotPrivateError`` when the file found there is not this user's
    alone (another user's, a link, a mode that lets others read it)."""
    path = os.path.join(folder, name)
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    temporary = os.path.join(folder, f"{name}.{secrets.token_hex(8)}")
    write_new_file(temporary, secrets.token_hex(32).encode())
    try:
        with contextlib.suppress(FileExistsError):
            os.link(temporary, path)
    finally:
        os.unlink(temporary)
    return _read_key(path)


def _read_key(path: str) -> bytes:
    fd = open_regular(path, max_size=4096)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise NotPrivateError(path, f"is owned by {user_name(info.st_uid)}, not by this user")
        if info.st_mode & 0o077:
            raise NotPrivateError(
                path, f"has mode {stat.S_IMODE(info.st_mode):04o}: other users may read it"
            )
        return os.read(fd, 4097).strip()
    finally:
        os.close(fd)


def remove_private_folder(path: str | os.PathLike) -> bool:
    """Remove the private folder ``path`` and everything in it; whether it was removed.

    A path that is missing, or is not a private folder of this user (another user's
    folder, a link), is left alone: ``False``. Links inside are removed, never followed.
    """
    try:
        check_private_folder(path)
    except (FileNotFoundError, NotPrivateError):
        return False
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(path)  # what rmtree left, were it empty
    return not os.path.lexists(path)
