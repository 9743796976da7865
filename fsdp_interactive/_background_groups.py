"""Objects made once per default process group (rank side), and the gloo groups of
collectives that run on a background thread beside training.

Creating a process group or a device mesh is collective and costs a rendezvous, so each is
made once and reused while the default group lives; a new default group (after
``destroy_process_group`` and a new ``init_process_group``) gets new ones.

A background thread's collectives must not share a process group with the main thread's:
ranks could issue them in different orders and wait for each other forever. Each purpose
(async checkpoint writes, overlapped gradient-norm gathers) gets a gloo group of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")

_made: dict[Hashable, tuple[dist.ProcessGroup, object]] = {}


def once_per_default_group(key: Hashable, create: Callable[[], T]) -> T:
    """``create()``'s result for ``key``, made on the first call under the current default
    process group and returned again afterwards.

    ``create`` is usually collective: every rank of the default group must make the first
    call for ``key``. Needs an initialized default group.
    """
    default = dist.group.WORLD
    if default is None:
        raise RuntimeError("no default process group: call torch.distributed.init_process_group")
    made = _made.get(key)
    if made is None or made[0] is not default:
        made = _made[key] = (default, create())
    return made[1]  # type: ignore[return-value]


def background_gloo_group(purpose: str) -> dist.ProcessGroup | None:
    """The gloo group reserved for ``purpose`` over the default group's ranks.

    ``None`` without a default process group. Created on first use, collectively: every
    rank of the default group must make that first call; kept while that group lives.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return once_per_default_group(
        ("background-gloo", purpose), lambda: dist.new_group(backend="gloo")
    )
