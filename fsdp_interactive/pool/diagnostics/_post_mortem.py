"""Post-mortem pdb on a rank, driven from the kernel one command at a time.

Each rank keeps the last exception a notebook cell raised there
(:mod:`pool.rank._debugger`); :func:`debug_command` sends one pdb command to that
rank's diagnostics agent and returns what pdb printed. The session lives on the rank
between commands (``up`` stays up) until ``q``. While it lives, every rank holds the NCCL
watchdog's clock (:mod:`pool.rank._watchdog_hold`) for ``hold_s`` seconds after each
command, so that peers waiting in a collective for the failed rank are not ended while
the user reads its frames; ``q`` releases the hold.
"""

from __future__ import annotations

from fsdp_interactive.pool.diagnostics._agent_client import RankAgents
from fsdp_interactive.pool.errors import PoolError


class DebuggerOutput(str):
    """What one post-mortem debugger command printed; ``active``: the session goes on."""

    active: bool

    def __new__(cls, text: str, active: bool) -> DebuggerOutput:
        output = super().__new__(cls, text)
        output.active = active
        return output


#: The name of the watchdog hold a post-mortem session keeps on every rank.
HOLD = "post-mortem"


def debug_command(
    agents: RankAgents, rank: int, command: str | None, hold_s: float = 0.0
) -> DebuggerOutput:
    """Run ``command`` (``None``: start or show where the session stands) in ``rank``'s
    post-mortem session. Raises :class:`PoolError` when the agent does not answer or the
    rank has no failure to look at. ``hold_s``: hold every rank's NCCL watchdog for that
    long while the session is open (0: no hold), released when it ends."""
    try:
        reply = agents.ask_one(rank, {"op": "debug", "command": command})
    except OSError as error:
        raise PoolError(f"rank {rank}'s diagnostics agent did not answer: {error}") from None
    if reply.get("failure") is None:
        raise PoolError(
            f"rank {rank} has no failure to debug: no cell run on the ranks "
            "(%%fsdp, or pool.run(..., cell=N)) raised there since the pool started"
        )
    active = bool(reply["active"])
    if hold_s > 0:
        seconds = hold_s if active else 0.0
        agents.ask(
            list(agents.addresses), {"op": "hold_watchdog", "name": HOLD, "seconds": seconds}
        )
    return DebuggerOutput(reply["output"], active=active)
