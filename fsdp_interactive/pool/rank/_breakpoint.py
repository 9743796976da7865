"""Rank side: ``fsdp_interactive.breakpoint()``, a live pdb stop on one rank of a cell.

The stopped rank's debugger (:class:`._debugger.LivePdb`) asks the notebook for
commands over the diagnostics agent's event link (:mod:`._agent`), or runs the
commands it was given; the other ranks poll the rendezvous store until it runs on.
Every rank holds the NCCL watchdog's clock meanwhile (:mod:`._watchdog_hold`), so that
no collective issued before the stop times out while the user types.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from fsdp_interactive.pool.rank import _agent, _bootstrap, _watchdog_hold
from fsdp_interactive.pool.rank._debugger import LivePdb, kernel_io, scripted_io

#: How often waiting ranks look whether the stopped rank ran on (a Python loop, so that
#: Ctrl-C and stack dumps still reach them).
_WAIT_POLL_S = 0.05
#: The name of the watchdog hold a breakpoint keeps on every rank.
_HOLD = "breakpoint"
_breakpoints = 0


def breakpoint(rank: int = 0, commands: Sequence[str] | None = None) -> None:
    """Stop rank ``rank`` at the next line of the calling cell; the other ranks wait.

    Call it on every rank (in a ``%%fsdp`` cell), like ``torch.distributed.breakpoint``.
    The stopped rank takes pdb commands from the notebook's input box (a plain
    ``pool.run`` asks with ``input()``), until a command runs the code on (``c``, ``n``,
    ``s``, ...); the other ranks wait until then. ``commands``: debugger commands to
    run instead of asking (e.g. ``["p x", "c"]``, for notebooks run unattended); the
    transcript goes to the rank's stderr and the debugger continues after the last.

    Raises ``RuntimeError`` outside a pool's rank (under torchrun use
    ``torch.distributed.breakpoint``) and ``ValueError`` for a rank that does not exist.
    """
    global _breakpoints
    me, world_size, _, _ = _bootstrap.rank_context()
    store = _bootstrap.rendezvous_store()
    if me < 0 or store is None:
        raise RuntimeError(
            "fsdp_interactive.breakpoint() works in a cell run on a pool's ranks "
            "(%%fsdp); in a torchrun script use torch.distributed.breakpoint()"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be a rank of the pool (0..{world_size - 1}), got {rank!r}")
    _breakpoints += 1
    key = f"fsdp_interactive/breakpoint/{_breakpoints}"
    if me != rank:
        with _watchdog_hold.held(_HOLD):
            while not store.check([key]):  # a Python loop: Ctrl-C and stacks still work here
                time.sleep(_WAIT_POLL_S)
        return
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            _watchdog_hold.release(_HOLD)
            store.set(key, "1")

    agent = _agent.current()
    link = agent.event_link() if agent is not None else None
    if commands is not None:
        ask, show = scripted_io([str(c) for c in commands])
    elif link is not None:
        ask, show = kernel_io(rank, link)
    else:
        release()
        raise RuntimeError(
            f"rank {rank} cannot ask the notebook for debugger commands (no kernel is "
            "connected); pass commands=[...] to fsdp_interactive.breakpoint()"
        )
    _watchdog_hold.hold(_HOLD)  # released when the debugger runs the code on
    debugger = LivePdb(rank, ask, show, release, agent.code_name if agent is not None else None)
    caller = sys._getframe(1)
    debugger.message(
        f"rank {rank} stopped; the other ranks wait until it runs on "
        "(c: continue, n: next line, p NAME: print a value, q: quit)"
    )
    debugger.set_trace(caller)
