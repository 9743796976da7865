"""What an interrupt did: wait for the signalled ranks to stop, and report per rank.

``pool.interrupt()`` forwards SIGINT to the targeted ranks. A rank running Python code
stops at the next bytecode; a rank blocked inside a C++ collective sees the signal only
when the collective returns, which may be never. :func:`settle` waits up to a grace
period for the busy ranks to stop, and gives up early once every rank still running is
blocked inside a collective (nothing SIGINT can stop); :class:`InterruptReport` says
what happened to each rank and what to do about a blocked one.

Not done here: sending the signal (the pool does, through ipyparallel's nanny) or
tearing the group down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fsdp_interactive.pool.diagnostics._diagnosis import Diagnosis
from fsdp_interactive.pool.errors import RECOVER, RESTART

#: Seconds after the signal before the still-running ranks are asked whether they are
#: blocked in a collective (asking sooner would catch ranks about to stop).
_BLOCKED_CHECK_S = 1.0
_POLL_S = 0.05


@dataclass(frozen=True)
class InterruptReport:
    """What ``pool.interrupt()`` did, per targeted rank.

    ``stopped``: ranks whose unfinished call ended after SIGINT; ``blocked``: ranks
    still inside a collective (where they are: in ``torch.distributed``, or waiting for
    the GPU behind an NCCL collective), which SIGINT cannot free (the signal is handled
    only once the C++ call returns) and only a new group does (``recover()`` or
    ``restart()``); ``left_behind``: stopped ranks that left an NCCL collective unfinished
    on their GPU (what), which also only a new group clears; ``running``: ranks that had not stopped yet, elsewhere; ``idle``:
    ranks that ran no call the pool was waiting for (they were signalled too);
    ``snapshot_taken``: whether a recovery has a snapshot to go back to (without one, only
    a restart is named).
    """

    signalled: list[int]
    stopped: list[int] = field(default_factory=list)
    blocked: dict[int, str] = field(default_factory=dict)
    running: dict[int, str] = field(default_factory=dict)
    idle: list[int] = field(default_factory=list)
    left_behind: dict[int, str] = field(default_factory=dict)
    snapshot_taken: bool = True

    @property
    def needs_restart(self) -> bool:
        return bool(self.blocked or self.left_behind)

    def lines(self, notebook: bool = False) -> list[str]:
        """One line per rank, then what to do when a rank stays blocked."""
        status = {rank: "stopped" for rank in self.stopped}
        status.update(
            {
                rank: f"stopped, but left {what} queued on its GPU"
                for rank, what in self.left_behind.items()
            }
        )
        status.update({rank: "was idle (nothing to stop)" for rank in self.idle})
        status.update(
            {
                rank: f"did not stop: blocked in a collective, {where}"
                for rank, where in self.blocked.items()
            }
        )
        status.update(
            {rank: f"has not stopped yet: {where}" for rank, where in self.running.items()}
        )
        lines = [f"rank {rank}: {status[rank]}" for rank in sorted(status)]
        if self.blocked or self.left_behind:
            why = []
            if self.blocked:
                why.append(
                    "A rank blocked inside a collective cannot be interrupted (it sees the "
                    "signal only when the collective returns)"
                )
            if self.left_behind:
                why.append("NCCL work left queued on a GPU blocks that rank's next collective")
            recover = RECOVER.render(notebook).replace("go back to the last snapshot with ", "")
            restart = RESTART.render(notebook).replace("start a fresh group with ", "")
            lines.append(
                "; ".join(why)
                + "; only a new group frees it: "
                + (f"{recover} (back to the last snapshot) or " if self.snapshot_taken else "")
                + f"{restart} (rank state is discarded)."
            )
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


def settle(
    signalled: list[int],
    busy: list[int],
    busy_ranks: Callable[[], list[int]],
    diagnosis: Diagnosis,
    grace: float,
) -> InterruptReport:
    """Wait up to ``grace`` seconds for the ``busy`` ranks (of the ``signalled`` ones) to
    stop; ``busy_ranks()`` tells which still run. Ranks still running afterwards are
    reported as blocked in a collective (with where) or as running elsewhere."""
    began = time.monotonic()
    still: list[int] = busy
    blocked: dict[int, str] = {}
    while still and time.monotonic() - began < grace:
        time.sleep(_POLL_S)
        still = [rank for rank in busy_ranks() if rank in busy]
        if still and time.monotonic() - began > _BLOCKED_CHECK_S and not blocked:
            blocked = diagnosis.blocked_in_collective(still)
            if set(blocked) == set(still):
                break  # nothing left that SIGINT can stop
    still = [rank for rank in busy_ranks() if rank in busy]
    if still:
        blocked = diagnosis.blocked_in_collective(still)
    running: dict[int, str] = {}
    if set(still) - set(blocked):
        running = diagnosis.stacks(ranks=[r for r in still if r not in blocked]).where
    stopped = [rank for rank in busy if rank not in still]
    idle = [rank for rank in signalled if rank not in busy]
    left_behind = diagnosis.unfinished_collectives(stopped)
    return InterruptReport(signalled, stopped, blocked, running, idle, left_behind)
