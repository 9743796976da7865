"""Exceptions raised by :class:`~fsdp_interactive.pool.Pool`.

Every error names ranks (never ipyparallel engine ids). Messages are plain text (ANSI
colour codes from remote tracebacks are stripped) so they read the same in a notebook,
a terminal and a log.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour escapes."""
    return _ANSI.sub("", text)


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# Parts of a traceback that differ between ranks running the same code: IPython's
# execution counter and the per-process cell file name.
_PER_PROCESS = re.compile(r"In\[\d+\]|ipykernel_\d+[/\\]\d+\.py")


def collapse(texts: dict[int, str]) -> list[tuple[list[int], str]]:
    """Group texts that are identical up to per-process details (cell counters/files).

    Returns ``[(ranks, text of the group's lowest rank), ...]`` ordered by lowest rank.
    """
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(_PER_PROCESS.sub("<cell>", texts[rank]), []).append(rank)
    return [(ranks, texts[ranks[0]]) for ranks in sorted(groups.values())]


class PoolError(RuntimeError):
    """Base class of the pool's own errors that are not about one run's outcome."""


class PoolStartError(PoolError):
    """The pool could not start; everything it had started has been stopped again."""


class PoolBusy(PoolError):
    """Ranks are still running an earlier call (one that timed out or was interrupted
    and did not stop); new work would queue behind it. Wait for it, interrupt it or
    restart the pool."""


class PoolNotRunning(PoolError):
    """The pool is stopped or broken (a rank died): call ``start()`` or ``restart()``."""


class RankError(RuntimeError):
    """One or more ranks raised.

    ``ranks`` lists them; ``tracebacks`` maps each to its plain-text traceback and
    ``errors`` to ``(exception type name, message)``. The message shows the lowest
    failing rank's traceback in full, names the ranks with the identical traceback and
    gives the last line of every different one.
    """

    def __init__(self, tracebacks: dict[int, str], errors: dict[int, tuple[str, str]]):
        self.ranks = sorted(tracebacks)
        self.tracebacks = {r: strip_ansi(t) for r, t in tracebacks.items()}
        self.errors = errors
        groups = collapse(self.tracebacks)
        first_ranks, first_text = groups[0]
        lines = [f"{_ranks_text(self.ranks)} raised; {_ranks_text(first_ranks)}:", first_text]
        for ranks, _ in groups[1:]:
            ename, evalue = errors.get(ranks[0], ("Error", ""))
            lines.append(f"{_ranks_text(ranks)}: {ename}: {evalue}")
        super().__init__("\n".join(lines))


class RankTimeout(TimeoutError):
    """A run did not finish within its timeout. The ranks were NOT stopped.

    ``stacks`` maps every targeted rank to its current Python stack (text, outermost
    frame first) and ``where`` to a one-line summary ("in barrier (...)").
    ``pending`` lists the ranks still running. ``wait(timeout)`` keeps waiting for the
    same run and returns its result (or raises as the run would have); the other choices
    are ``pool.interrupt()`` and ``pool.restart()``.
    """

    def __init__(
        self,
        message: str,
        stacks: dict[int, str],
        where: dict[int, str],
        pending: list[int],
        wait: Callable[[float | None], Any],
    ):
        super().__init__(message)
        self.stacks = stacks
        self.where = where
        self.pending = pending
        self._wait = wait

    def wait(self, timeout: float | None = None) -> Any:
        """Keep waiting for the timed-out run (``None``: no limit)."""
        return self._wait(timeout)


class RankDied(RuntimeError):
    """One or more rank processes died. The pool tore the group down; call ``restart()``.

    ``ranks`` lists the dead ranks; ``exit_codes`` maps each to its exit status
    (negative: killed by that signal; ``None``: unknown, e.g. a remote engine);
    ``log_tails`` maps each to the last lines of its engine's log.
    """

    def __init__(
        self,
        ranks: list[int],
        exit_codes: dict[int, int | None],
        log_tails: dict[int, str],
        hosts: dict[int, str] | None = None,
        pids: dict[int, int] | None = None,
    ):
        self.ranks = sorted(ranks)
        self.exit_codes = exit_codes
        self.log_tails = log_tails
        lines = []
        for rank in self.ranks:
            where = ""
            if pids and rank in pids:
                where = f" (pid {pids[rank]}" + (f" on {hosts[rank]}" if hosts else "") + ")"
            lines.append(f"rank {rank}{where} died: {describe_exit(exit_codes.get(rank))}")
        lines.append("The process group was torn down; call pool.restart() for a fresh one.")
        for rank in self.ranks:
            tail = log_tails.get(rank, "").rstrip()
            if tail:
                lines.append(f"--- last lines of rank {rank}'s engine log ---\n{tail}")
        super().__init__("\n".join(lines))


class RankInterrupted(KeyboardInterrupt):
    """A run was interrupted; SIGINT was forwarded to its ranks.

    ``ranks`` are the ranks that were signalled; ``stuck`` maps ranks that did not stop
    to a one-line description of where they are; ``needs_restart`` is True when an
    interrupt landed inside (or left a rank blocked in) a ``torch.distributed`` call, in
    which case the process group's state is undefined and ``pool.restart()`` is needed.
    """

    def __init__(self, ranks: list[int], stuck: dict[int, str], in_collective: list[int]):
        self.ranks = sorted(ranks)
        self.stuck = stuck
        self.in_collective = sorted(in_collective)
        self.needs_restart = bool(in_collective)
        lines = [f"interrupted {_ranks_text(self.ranks)} (SIGINT)."]
        for rank, where in sorted(stuck.items()):
            lines.append(f"rank {rank} did not stop: {where}")
        if self.needs_restart:
            lines.append(
                f"{_ranks_text(self.in_collective)} interrupted inside torch.distributed: "
                "the process group must be restarted (pool.restart())."
            )
        super().__init__("\n".join(lines))


def describe_exit(code: int | None) -> str:
    """``-9`` -> "killed by signal SIGKILL", ``3`` -> "exit code 3", ``None`` -> "exit status unknown"."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"killed by signal {name}"
    return f"exit code {code}"
