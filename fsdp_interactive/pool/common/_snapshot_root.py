"""Where a pool's snapshots live on each host: one folder per pool, in host memory.

The kernel chooses the folder once per ``Pool`` object (:func:`new_root`: kept across
``restart()``), and every engine finds it in :data:`ENV_VAR`. Ranks on one host share
the folder; ranks on other hosts have their own folder at the same path. Each host's
engine forker removes it when it exits (pool stopped, kernel gone; not when a rank dies),
and so does the orphan reaper on the kernel's host (:func:`remove_root`).

Standard library only: the engine forker and the reaper import it in processes that
must start fast.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile

log = logging.getLogger(__name__)

#: The environment variable that names the pool's snapshot root in every engine.
ENV_VAR = "FSDPI_SNAPSHOT_ROOT"
#: Host memory on Linux; elsewhere the temporary directory is used.
SHARED_MEMORY = "/dev/shm"
PREFIX = "fsdpi-"


def new_root() -> str:
    """A fresh snapshot root path for one pool: ``/dev/shm/fsdpi-<12 hex digits>``.

    Only the path is chosen; nothing is created (the ranks create it when they first
    write a snapshot).
    """
    base = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else tempfile.gettempdir()
    return os.path.join(base, f"{PREFIX}{secrets.token_hex(6)}")


def remove_root(path: str | None) -> bool:
    """Remove the snapshot root ``path`` and everything in it; whether it existed.

    A path whose last part does not start with :data:`PREFIX` is refused
    (``ValueError``): only a folder chosen by :func:`new_root` is ever removed.
    """
    if not path:
        return False
    if not os.path.basename(os.path.normpath(path)).startswith(PREFIX):
        raise ValueError(f"not a pool's snapshot root (fsdpi-...): {path!r}")
    existed = os.path.lexists(path)
    shutil.rmtree(path, ignore_errors=True)
    if existed:
        log.debug("snapshot root %s removed", path)
    return existed
