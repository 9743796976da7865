"""A pool's socket folder: where the processes of a one-host pool listen, as unix sockets
no other local user can reach.

Loopback TCP is open to every local user: anyone can connect to a port on 127.0.0.1,
subscribe to a PUB socket there and read what it publishes (every cell's source, every
rank's output). A unix socket is a file: to connect to one, a process must be able to
enter the folder that holds it. So a one-host pool keeps all its listeners in one private
folder (mode 0700, owned by the user, made new by the kernel before anything starts):
the controller's channels (ipyparallel's ``ipc`` transport), each engine's nanny and
heartbeat monitor, each rank's diagnostics agent.

The folder is made under ``$XDG_RUNTIME_DIR`` when that is a private folder of the user,
else in the system's temporary folder (``/tmp``), under a fresh random name
(``fsdpi-sockets-*``, made with ``mkdir``, which refuses a name that exists: nobody can
have made it first); a base folder another user could change (not sticky and writable by
others, or owned by another user) is not used. Its path reaches the processes that
listen in it through their environment (:data:`ENV_VAR`) or the rank's join request,
never a command line. The kernel removes it when the pool stops, and the orphan reaper
when the kernel dies.

Standard library only (both sides import it: the kernel, the controller's and engines'
entries, the ranks).
"""

from __future__ import annotations

import logging
import os
import tempfile

from fsdp_interactive import _path_trust, _private_files

log = logging.getLogger(__name__)

#: The environment variable naming the socket folder in the controller's and engines'
#: environment.
ENV_VAR = "FSDPI_SOCKET_FOLDER"
PREFIX = "fsdpi-sockets-"
#: A unix socket's path holds at most 107 bytes; the names put in the folder are shorter
#: than this.
_LONGEST_NAME = 32
_SUN_PATH = 107


def _bases() -> list[str]:
    """Where the folder may go, best first."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    candidates = [runtime] if runtime else []
    candidates += [tempfile.gettempdir(), "/tmp"]
    return list(dict.fromkeys(candidates))


def _usable(base: str) -> bool:
    if len(os.path.join(base, PREFIX + "x" * 8)) + 1 + _LONGEST_NAME > _SUN_PATH:
        return False
    if not os.path.isdir(base) or not os.access(base, os.W_OK | os.X_OK):
        return False
    return _path_trust.open_ancestor(os.path.join(base, PREFIX)) is None


def make_folder() -> str:
    """A new socket folder (see the module); ``OSError`` naming the folders tried when no
    base folder is fit for one."""
    tried = []
    for base in _bases():
        if not _usable(base):
            tried.append(base)
            continue
        folder = tempfile.mkdtemp(prefix=PREFIX, dir=base)  # mode 0700, a new name
        _private_files.check_private_folder(folder)
        log.debug("socket folder %s", folder)
        return folder
    raise OSError(
        "no folder to keep the pool's sockets in: "
        + ", ".join(tried)
        + " are missing, not writable, too long for a unix socket's path, or writable by "
        "other users without the sticky bit; set TMPDIR to a folder of yours"
    )


def socket_path(folder: str, name: str) -> str:
    """The path of the socket ``name`` in ``folder`` (``ValueError`` for a name longer than
    the folder leaves room for)."""
    if len(name) > _LONGEST_NAME or not _private_files.is_plain_name(name):
        raise ValueError(f"not a socket name of the folder: {name!r}")
    return os.path.join(folder, name)


def ipc_url(folder: str, name: str) -> str:
    """The ZeroMQ ``ipc://`` address of the socket ``name`` in ``folder``."""
    return "ipc://" + socket_path(folder, name)


def remove_folder(path: str | None) -> bool:
    """Remove the socket folder ``path`` and what is in it; whether it was removed. Only a
    folder named by :func:`make_folder` that is a private folder of this user is removed
    (``ValueError`` for another name)."""
    if not path:
        return False
    if not os.path.basename(os.path.normpath(path)).startswith(PREFIX):
        raise ValueError(f"not a pool's socket folder ({PREFIX}...): {path!r}")
    removed = _private_files.remove_private_folder(path)
    if removed:
        log.debug("socket folder %s removed", path)
    return removed
