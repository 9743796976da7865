"""What the magics read from the user and show back (notebook side).

Rank lists typed after ``--targets``, pool errors shown as their own message (in magic
words), a one-line description of a pulled value, and the execution count the notebook
shows for the running cell.
"""

from __future__ import annotations

import os
from typing import Any

from IPython.core.error import UsageError


def parse_targets(text: str, world_size: int) -> list[int] | None:
    """``"all"`` -> None; ``"0,2"``, ``"1"``, ``"0-2"`` -> a sorted list of ranks."""
    text = text.strip()
    if text == "all":
        return None
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(p) for p in part.split("-", 1))
                if hi < lo:
                    raise ValueError(part)
                ranks.update(range(lo, hi + 1))
            else:
                ranks.add(int(part))
    except ValueError:
        raise UsageError(
            f"--targets {text!r} is not a rank list; type e.g. --targets 0, --targets 0,1, "
            "--targets 0-1 or --targets all"
        ) from None
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise UsageError(
            f"--targets {text}: rank(s) {bad} do not exist; the pool has ranks 0..{world_size - 1} "
            f"(type --targets 0-{world_size - 1} or --targets all)"
        )
    return sorted(ranks)


def rank_error_class() -> type:
    from fsdp_interactive.pool.errors import RankError

    return RankError


def pool_failures() -> tuple[type[BaseException], ...]:
    from fsdp_interactive.pool.errors import (
        PoolError,
        RankDied,
        RankError,
        RankInterrupted,
        RankTimeout,
    )

    return (RankError, RankTimeout, RankDied, RankInterrupted, PoolError)


def shown_message(error: BaseException, out: str | None = None) -> str:
    """The error's message for a notebook user: what to do next in magics
    (``%fsdp restart``), not in API calls; ``out`` is the name ``-o`` stored it under."""
    return error.notebook_message(out) if hasattr(error, "notebook_message") else str(error)


def shown_as_message(error: BaseException, out: str | None = None) -> BaseException:
    """Make IPython show the error's own text (the ranks' tracebacks), not the magic's frames,
    in a notebook user's words (:func:`shown_message`)."""
    text = f"{type(error).__name__}: {shown_message(error, out)}"
    error._render_traceback_ = lambda: text.splitlines()  # type: ignore[attr-defined]
    return error


def current_cell_number(shell: Any) -> int | None:
    """The execution count the notebook shows for the cell being run.

    IPython records it on the result of the running cell (``displayhook.exec_result``);
    ``shell.execution_count`` alone is the current cell's number before IPython 9 and
    the next one's from IPython 9 on.
    """
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(running, "execution_count", None)
    if isinstance(number, int):
        return number
    count = getattr(shell, "execution_count", None)
    return count if isinstance(count, int) else None


def describe_value(value: Any) -> str:
    """``Tensor (64, 32) float32``, ``dict (3 items)``, ``int 7``: what a pull brought."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    kind = type(value).__name__
    if shape is not None and dtype is not None:
        dims = tuple(int(d) for d in shape)
        return f"{kind} {dims} {str(dtype).removeprefix('torch.')}"
    if isinstance(value, dict | list | tuple | set):
        return f"{kind} ({len(value)} items)"
    text = repr(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def cell_hang_notice(seconds: float | None, off: bool, command: str) -> float | bool | None:
    """What ``--hang-notice S`` / ``--no-hang-notice`` of ``command`` ask for: seconds,
    ``False`` (no notice) or ``None`` (neither given); ``UsageError`` for both, or for
    seconds that are not > 0."""
    if off and seconds is not None:
        raise UsageError(f"{command}: type either --hang-notice S or --no-hang-notice, not both")
    if off:
        return False
    if seconds is not None and not 0 < seconds < float("inf"):
        raise UsageError(
            f"{command} --hang-notice {seconds:g}: type a number of seconds > 0 "
            "(or --no-hang-notice for none)"
        )
    return seconds


def stream_default() -> bool:
    """Stream a cell's output unless ``IPP_NONINTERACTIVE`` is set (as ``%%px`` does, for
    nbval runs)."""
    return os.environ.get("IPP_NONINTERACTIVE", "") in ("", "0")
