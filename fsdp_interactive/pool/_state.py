"""The states of a :class:`pool.Pool` and the moves between them."""

from __future__ import annotations

from enum import Enum


class PoolState(str, Enum):
    """Where a pool is in its life; a ``str``, so ``pool.state == "running"`` holds.

    Transitions::

        STOPPED  --start()-->            STARTING
        STARTING --group formed-->       RUNNING   (namespaces set up; calls allowed)
        STARTING --start-up failed-->    STOPPED   (everything started was stopped)
        RUNNING  --a rank died-->        BROKEN    (group torn down; processes ended)
        BROKEN   --start()/restart()-->  STOPPED --> STARTING
        any      --stop()-->             STOPPED
        RUNNING  --restart()-->          STOPPED --> STARTING

    Only RUNNING accepts calls (``run``, ``call``, ``push``, ``pull``, ``stacks``,
    ``interrupt``); the others raise :class:`pool.PoolNotRunning`.
    """

    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    BROKEN = "broken"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
