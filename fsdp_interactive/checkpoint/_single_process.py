"""DCP in one process: its single-process warning is expected there, not a problem."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def single_process_quietly() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save/load in a single process" warning,
    which is expected when no process group exists (one-process use, conversions) and
    for every load (each rank reads alone: ``_safe_reader.safe_load``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
