"""Gloo groups for collectives that run on a background thread beside training (rank side).

A background thread's collectives must not share a process group with the main thread's:
ranks could issue them in different orders and wait for each other forever. Each purpose
(async checkpoint writes, overlapped gradient-norm gathers) gets a gloo group of its own,
created once per default process group.
"""

from __future__ import annotations

import torch.distributed as dist

_groups: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def background_gloo_group(purpose: str) -> dist.ProcessGroup | None:
    """The gloo group reserved for ``purpose`` over the default group's ranks.

    ``None`` without a default process group. Created on first use, collectively: every
    rank of the default group must make that first call; kept while that group lives.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    default = dist.group.WORLD
    cached = _groups.get(purpose)
    if cached is None or cached[0] is not default:
        cached = _groups[purpose] = (default, dist.new_group(backend="gloo"))
    return cached[1]
