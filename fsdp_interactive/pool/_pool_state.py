"""The states of a :class:`pool.Pool`, the moves between them, and what ``Pool.check()``
reports of them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class PoolState(str, Enum):
    """Where a pool is in its life; a ``str``, so ``pool.state == "running"`` holds.

    Transitions::

        STOPPED  --start()-->            STARTING
        STARTING --group formed-->       RUNNING   (namespaces set up; calls allowed)
        STARTING --start-up failed-->    STOPPED   (everything started was stopped)
        RUNNING  --a rank died-->        BROKEN    (group torn down; processes ended),
                                           seen by the call it died in, or by the next
                                           call or Pool.check() when it died between calls
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


@dataclass(frozen=True)
class PoolHealth:
    """What ``Pool.check()`` found: the pool's ``state`` and ``world_size``, the
    ``RankDied`` its last group was torn down for (``death``; ``None`` while it runs),
    whether no call has raised that error yet (``unreported``: the next call will, instead
    of running), and one line per engine forker that ended and was replaced
    (``forker_deaths``)."""

    state: PoolState
    world_size: int
    death: Any = None
    forker_deaths: tuple[str, ...] = ()
    unreported: bool = False

    def lines(self, notebook: bool = False) -> list[str]:
        """The state as lines of text, what to do next in API calls or (``notebook``) in
        magics."""
        if self.state is PoolState.RUNNING:
            lines = [f"pool running, {self.world_size} ranks"]
        elif self.death is not None:
            message = self.death.notebook_message() if notebook else str(self.death)
            lines = [f"pool {self.state}: {message}"]
        else:
            lines = [f"pool {self.state}"]
        return lines + [f"note: {line}" for line in self.forker_deaths]
