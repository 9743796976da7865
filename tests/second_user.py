"""Acting as another local user, for the tests of what a pool keeps private.

:func:`as_other_user` runs a function in a forked child that has dropped to another uid
(``nobody``, 65534, by default) and returns what it returned (plain data, through a
pipe), or re-raises what it raised as :class:`OtherUserError` with its type and message.
Only the superuser can change uid: :func:`require_root` skips a test elsewhere, and fails
it instead where ``FSDPI_REQUIRE_SECOND_USER=1`` (CI runs as root and sets it).

Shared places such as ``/dev/shm`` are where another user can act; the test's own
``tmp_path`` is private to root, so attacks are staged under :func:`shared_path`.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

#: The other user: ``nobody`` on Debian.
OTHER_UID = OTHER_GID = 65534
SHARED = Path("/dev/shm")


class OtherUserError(RuntimeError):
    """What the function raised as the other user: ``kind`` (its type's name) and text."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(f"{kind}: {message}")


def require_root() -> None:
    """Skip (or, with ``FSDPI_REQUIRE_SECOND_USER=1``, fail) unless this process may act
    as another user."""
    if os.geteuid() == 0:
        return
    reason = "acting as a second user needs root (os.setuid)"
    if os.environ.get("FSDPI_REQUIRE_SECOND_USER") == "1":
        pytest.fail(f"FSDPI_REQUIRE_SECOND_USER=1 but {reason}")
    pytest.skip(reason)


def as_other_user(fn: Callable[..., Any], *args: Any, uid: int = OTHER_UID) -> Any:
    """``fn(*args)`` run by user ``uid`` (a forked child, no supplementary groups)."""
    require_root()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the other user, run, report, exit
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                outcome: tuple[str, Any] = ("ok", fn(*args))
            except BaseException as exc:  # reported to the parent
                outcome = ("raised", (type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
            with os.fdopen(write_end, "wb") as pipe:
                pickle.dump(outcome, pipe)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise OtherUserError(*value)
    return value


@contextmanager
def shared_path(prefix: str = "fsdpi-test-") -> Iterator[Path]:
    """A fresh, unused path in ``/dev/shm`` (nothing is made there), removed afterwards
    with whatever anybody put there."""
    path = SHARED / f"{prefix}{secrets.token_hex(6)}"
    try:
        yield path
    finally:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path, ignore_errors=True)
