"""Where a pool's snapshots live on each host: one private folder per pool, in host memory,
and the key that authenticates what is written there.

The kernel chooses the folder's path and the key once per ``Pool`` object
(:func:`new_root`, :func:`new_key`: kept across ``restart()``); every rank finds them in
:data:`ENV_VAR` and :data:`KEY_ENV_VAR` (set in its environment as it joins the group,
never on a command line). Each host's folder is made once, at pool start, by that host's
engine forker (:func:`create_root`): mode 0700, owned by this user, and refused when the
path exists (another user could have made it first, with rights of their choosing). Ranks
on one host share the folder; ranks on other hosts have their own at the same path. Each
host's engine forker removes it when it exits (pool stopped, kernel gone; not when a rank
dies), and so does the orphan reaper on the kernel's host (:func:`remove_root`).

Standard library only: the engine forker and the reaper import it in processes that
must start fast.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile

from fsdp_interactive import _private_files

log = logging.getLogger(__name__)

#: The environment variable that names the pool's snapshot root in every engine.
ENV_VAR = "FSDPI_SNAPSHOT_ROOT"
#: The environment variable holding the pool's snapshot key (hex) in every engine.
KEY_ENV_VAR = "FSDPI_SNAPSHOT_KEY"
#: Host memory on Linux; elsewhere the temporary directory is used.
SHARED_MEMORY = "/dev/shm"
PREFIX = "fsdpi-"


def new_root() -> str:
    """A fresh snapshot root path for one pool: ``/dev/shm/fsdpi-<12 hex digits>``.

    Only the path is chosen; each host's engine forker creates it (:func:`create_root`).
    """
    base = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else tempfile.gettempdir()
    return os.path.join(base, f"{PREFIX}{secrets.token_hex(6)}")


def new_key() -> str:
    """A fresh snapshot key for one pool: 32 random bytes, as hex."""
    return secrets.token_hex(32)


def _check_name(path: str) -> None:
    if not os.path.basename(os.path.normpath(path)).startswith(PREFIX):
        raise ValueError(f"not a pool's snapshot root (fsdpi-...): {path!r}")


def create_root(path: str, *, adopt: bool = False) -> str:
    """Create the pool's snapshot root ``path`` on this host: a private folder (mode 0700,
    this user's); ``"created"`` or, with ``adopt``, ``"adopted"`` when it was there.

    Refused (:class:`~fsdp_interactive._private_files.NotPrivateError`, naming the path
    and what is wrong) when ``path`` exists, is a link or belongs to someone else; with
    ``adopt`` (the pool's forker on this host is replaced: the one before made it) an
    existing folder is used only when it is a private folder of this user. ``ValueError``
    for a path :func:`new_root` did not choose.
    """
    _check_name(path)
    created = _private_files.make_private_folder(path, exist_ok=adopt)
    log.debug("snapshot root %s %s", path, "created" if created else "adopted")
    return "created" if created else "adopted"


def remove_root(path: str | None) -> bool:
    """Remove the snapshot root ``path`` and everything in it; whether it was removed.

    A path whose last part does not start with :data:`PREFIX` is refused
    (``ValueError``): only a folder chosen by :func:`new_root` is ever removed. A folder
    that is not a private folder of this user (someone else's, a link) is left alone.
    """
    if not path:
        return False
    _check_name(path)
    removed = _private_files.remove_private_folder(path)
    if removed:
        log.debug("snapshot root %s removed", path)
    elif os.path.lexists(path):
        log.warning("snapshot root %s is not a private folder of this user: left alone", path)
    return removed
