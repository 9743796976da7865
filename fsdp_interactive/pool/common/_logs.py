"""Turning on the package's log records, in the notebook kernel and on the ranks.

Every module logs through ``logging.getLogger(__name__)`` under ``fsdp_interactive``, at
DEBUG and INFO only, and nothing is configured by default, so nothing is shown. A level
(``Pool(log_level="debug")``, ``%fsdp start --log-level debug`` or the environment
variable ``FSDPI_LOG_LEVEL=debug`` for scripts) attaches one handler to the
``fsdp_interactive`` logger that writes to whatever ``sys.stderr`` is when a record is
emitted: in a notebook kernel that is the current cell's output, on an engine it is the
stream ipyparallel sends back to the kernel, where the pool prints it tagged
``[rank N:stderr]``.

Free of IPython and ipyparallel: the rank side (:mod:`pool.rank._bootstrap`) uses it too.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

ENV_VAR = "FSDPI_LOG_LEVEL"
PACKAGE_LOGGER = "fsdp_interactive"

_NAMES = ("debug", "info", "warning", "error", "critical")
_FORMAT = "%(levelname)s %(name)s: %(message)s"


def parse_level(value: object, name: str = "log_level") -> int | None:
    """A :mod:`logging` level from a name (``"debug"``, any case) or a number; ``None`` stays.

    Raises ``ValueError`` naming ``name`` for anything else.
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.strip().lower() in _NAMES:
        return logging.getLevelName(value.strip().upper())
    raise ValueError(
        f"{name} must be a logging level name ({', '.join(map(repr, _NAMES))}) or a "
        f"non-negative number, got {value!r}"
    )


def level_from_env() -> int | None:
    """The level ``$FSDPI_LOG_LEVEL`` asks for (``None`` when unset or empty)."""
    value = os.environ.get(ENV_VAR, "").strip()
    return parse_level(value, name=ENV_VAR) if value else None


class _CurrentStderr(logging.StreamHandler):
    """A stream handler that writes to ``sys.stderr`` as it is at each record.

    IPython and ipykernel replace ``sys.stderr`` after start-up (and per cell); a plain
    ``StreamHandler`` would keep writing to the stream it was created with.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


_handler: logging.Handler | None = None


def enable(level: int) -> None:
    """Show this package's records at ``level`` and above on ``sys.stderr``; idempotent.

    A later call changes the level. Handlers the application configured itself are
    left alone; records still propagate to them.
    """
    global _handler
    logger = logging.getLogger(PACKAGE_LOGGER)
    if _handler is None:
        _handler = _CurrentStderr()
        _handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(_handler)
    _handler.setLevel(level)
    logger.setLevel(level)
