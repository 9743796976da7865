"""A per-thread switch that makes ``module.state_dict()`` return the native state.

The FSDP1-style ``state_dict`` hooks of :mod:`fsdp_interactive.fsdp._state_dict_utils`
reshape a module's state to the active ``state_dict_type`` (full tensors, local shards).
Code that needs FSDP2's native sharded (DTensor) state whatever type is active (DCP's
state-dict helpers, checkpoints) runs inside :func:`raw_state_dict`; the hooks ask
:func:`hooks_suspended` and step aside.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_raw = threading.local()


@contextlib.contextmanager
def raw_state_dict() -> Iterator[None]:
    """Within this context (on this thread) ``module.state_dict()`` returns the native
    (DTensor) state and ``load_state_dict`` takes it. Nests."""
    depth = getattr(_raw, "depth", 0)
    _raw.depth = depth + 1
    try:
        yield
    finally:
        _raw.depth = depth


def hooks_suspended() -> bool:
    """True inside :func:`raw_state_dict` (on this thread)."""
    return getattr(_raw, "depth", 0) > 0
