"""What another user puts in place of a file a load reads, for the tests that show it is
refused without being read: a FIFO (opened to read, it waits for a writer for good), a
link to ``/dev/zero`` (read, it never ends), an enormous sparse file; and the two checks
that nothing hung (:func:`in_time`) and nothing was read into memory
(:func:`peak_rss_bytes` before and after)."""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

KINDS = ("fifo", "dev-zero", "huge")


def put_in_place(path: Path, how: str) -> None:
    """Replace the file ``path`` with a FIFO, a link to ``/dev/zero`` or a 1 TiB sparse file."""
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dev-zero":
        path.symlink_to("/dev/zero")
    elif how == "huge":
        with open(path, "wb") as f:
            f.truncate(1 << 40)
    else:
        raise ValueError(f"how must be one of {KINDS}, got {how!r}")


def in_time(fn: Callable[[], Any], seconds: float = 60) -> Any:
    """``fn()`` on a thread; fails the test when it has not returned in ``seconds`` (a
    read that hangs would never return: a guard, not a measurement)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds}s: it hangs"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (it only grows)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
