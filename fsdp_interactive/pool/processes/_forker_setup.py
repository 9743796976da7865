"""The first line an engine forker reads: what its owner tells it before anything else,
off the command line (which ``ps`` shows every user), and the snapshot root it makes.

The owner writes ``{"snapshot_root": DIR or null, "adopt": false}`` as the first line of
the forker's stdin (over ssh for another host). The forker reads exactly that line (the
bytes after it are the first requests, handed on), then creates the pool's snapshot root
on its host as a private folder (:func:`._snapshot_root.create_root`), before it imports
anything: the root exists, mode 0700, from pool start on. A root that is refused (the
path exists, is a link, is another user's) is not used and never removed; the forker
then refuses every fork request with the reason, so that the pool's start fails naming
it.

Standard library only (it runs before the forker's imports).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.pool.common import _snapshot_root

#: The longest setup line a forker accepts.
MAX_SETUP_BYTES = 64 * 1024


@dataclass(frozen=True)
class ForkerSetup:
    """What the owner told the forker: the pool's snapshot root on this host (``None``:
    none) and whether an existing private folder there may be used (``adopt``)."""

    snapshot_root: str | None = None
    adopt: bool = False

    def line(self) -> bytes:
        """The setup as the line the owner writes."""
        return (
            json.dumps({"snapshot_root": self.snapshot_root, "adopt": self.adopt}) + "\n"
        ).encode()

    @classmethod
    def parse(cls, line: bytes) -> ForkerSetup:
        """The setup in ``line``; ``ValueError`` when it is not one."""
        data: Any = json.loads(line) if line.strip() else {}
        if not isinstance(data, dict):
            raise ValueError(f"the setup must be a JSON object, got {type(data).__name__}")
        root, adopt = data.get("snapshot_root"), data.get("adopt", False)
        if (root is not None and not isinstance(root, str)) or not isinstance(adopt, bool):
            raise ValueError("setup: snapshot_root must be a string or null, adopt true or false")
        return cls(root or None, adopt)


def read_setup(fd: int) -> tuple[ForkerSetup, bytes]:
    """Read the setup line from ``fd``: ``(setup, the bytes read after it)``. A channel that
    closes first gives an empty setup (the owner is gone: the forker ends)."""
    data = b""
    while b"\n" not in data and len(data) <= MAX_SETUP_BYTES:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return ForkerSetup.parse(line), rest


@dataclass
class RootState:
    """The snapshot root as this forker found it: ``made`` (``"created"``/``"adopted"``,
    then it is this forker's to remove) or ``refused`` (the reason)."""

    path: str | None = None
    made: str | None = None
    refused: str | None = None

    @property
    def owned(self) -> str | None:
        """The root this forker removes when it exits (``None``: none, or one it refused)."""
        return self.path if self.made else None

    def report(self) -> dict[str, Any]:
        return {"snapshot_root": self.made, "snapshot_root_error": self.refused}


def prepare_root(setup: ForkerSetup) -> RootState:
    """Create (or, with ``setup.adopt``, adopt) the snapshot root of ``setup``."""
    state = RootState(setup.snapshot_root)
    if setup.snapshot_root is None:
        return state
    try:
        state.made = _snapshot_root.create_root(setup.snapshot_root, adopt=setup.adopt)
    except (OSError, ValueError) as exc:
        state.refused = (
            f"refusing the pool's snapshot root on this host: {exc}. Another user may have "
            "made it first; nothing was written there, and no engine starts. A new pool "
            "(%fsdp stop, then %fsdp start; or a new Pool) chooses a new path"
        )
    return state
