"""torch FSDP1's deprecation notices, silenced where this package's own calls make them.

A torch ``FullyShardedDataParallel`` (FSDP1) model's sharded state dict holds
``ShardedTensor`` values, which torch deprecates: every state dict, DCP plan and load of
one warns (``Please use DTensor instead and we are deprecating ShardedTensor``, and that
``_get_pg_default_device`` will be deprecated and cannot tell a gloo group's device), 18
lines per save or snapshot and 36 per load, in words about torch internals the user did
not choose and cannot change. :func:`fsdp1_quietly` silences exactly those while a save,
load, snapshot or restore runs; every other warning is shown as usual.

Python's warning filters are the process's: while one of these calls runs, another
thread's warning of the same text is silenced too.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: The messages silenced (regular expressions matched at the message's start).
NOTICES = (
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`_get_pg_default_device` will be deprecated",
    "Multiple backends are registered with this ProcessGroup",
)


@contextlib.contextmanager
def fsdp1_quietly() -> Iterator[None]:
    """Silence torch's notices about FSDP1's ``ShardedTensor`` state (:data:`NOTICES`)."""
    with warnings.catch_warnings():
        for notice in NOTICES:
            warnings.filterwarnings("ignore", message=notice)
        yield


def quietly(fn: F) -> F:
    """``fn`` run under :func:`fsdp1_quietly`."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with fsdp1_quietly():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
