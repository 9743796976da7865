"""Rank agreement over a process group (or none: a single process); rank side.

A step that can fail on one rank (a bad path, a corrupt file) is turned into a verdict
all ranks share, so they raise the same error together instead of leaving peers blocked
in the next collective. Objects travel with ``all_gather_object`` /
``broadcast_object_list``: meant for small plain data, not tensors of real size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class Ranks:
    """The ranks of ``group`` (``None``: the default group) as seen from this rank.

    Without an initialised process group (or with ``local=True``) it is one rank of a
    world of one, and every collective is a no-op.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, local: bool = False):
        self.distributed = not local and dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.size = dist.get_world_size(group) if self.distributed else 1

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed or self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed or self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def run_on_rank0(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only; every rank returns its result or raises its error."""
        result: tuple[bool, Any]
        if self.rank == 0:
            try:
                result = (True, fn())
            except Exception as exc:
                result = (False, exc)
        else:
            result = (True, None)
        ok, value = self.from_rank0(result)
        if not ok:
            raise value
        return value

    def agree(self, error: Exception | None) -> None:
        """Raise the lowest rank's error on every rank if any rank has one."""
        for err in self.all_gather(error):
            if err is not None:
                raise err
