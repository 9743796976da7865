"""The pool's own options, checked when a ``Pool`` is made (before anything starts).

Where ranks go (``n``, ``devices``, ``backend``) is :mod:`._placement`'s; what is checked
here is the rest: the launcher's name, time limits, the flight recorder's size, the
collective checks, automatic recovery, start-up's progress and its oversubscription warning. Each bad value raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import os
from typing import Any

from fsdp_interactive.pool.rank._torch_recorder import BUFFER_ENV

#: Flight-recorder entries per rank unless ``flight_recorder=`` or the environment says.
DEFAULT_FLIGHT_RECORDER = 64


def check_options(
    *,
    engines: Any,
    timeout: Any,
    pg_timeout: Any,
    flight_recorder: Any,
    check_collectives: Any,
    recover: Any = None,
    oversubscribe: Any = False,
    show_progress: Any = True,
) -> None:
    """Raise ``ValueError`` for the first option that is not what ``Pool`` takes."""
    for name, flag in (("oversubscribe", oversubscribe), ("show_progress", show_progress)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if flight_recorder is not None and (
        isinstance(flight_recorder, bool)
        or not isinstance(flight_recorder, int)
        or flight_recorder < 0
    ):
        raise ValueError(
            "flight_recorder must be a number of entries >= 0 (0: off) or None, "
            f"got {flight_recorder!r}"
        )
    if not isinstance(check_collectives, bool):
        raise ValueError(f"check_collectives must be True or False, got {check_collectives!r}")
    for name, value in (("timeout", timeout), ("pg_timeout", pg_timeout)):
        if not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if recover not in (None, "auto"):
        raise ValueError(f"recover must be 'auto' or None, got {recover!r}")
    if not isinstance(engines, str) or not engines:
        raise ValueError(f"engines must be a launcher name such as 'local', got {engines!r}")


def flight_recorder_entries(asked: int | None) -> int | None:
    """The ranks' ring-buffer size: as asked, else ``None`` when the environment sets
    ``TORCH_FR_BUFFER_SIZE`` (the engines inherit it), else the default."""
    if asked is not None:
        return asked
    if os.environ.get(BUFFER_ENV):
        return None
    return DEFAULT_FLIGHT_RECORDER
