"""Exceptions raised by :class:`pool.Pool`.

Every error names ranks (never ipyparallel engine ids). Messages are plain text (ANSI
colour codes from remote tracebacks are stripped) so they read the same in a notebook,
a terminal and a log. Errors that say what to do next (:class:`Advised`) say it in API
calls (``pool.restart()``) in ``str(error)`` and in magics (``%fsdp restart``) in
``error.notebook_message()``, which the magics show.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Step:
    """One thing the reader can do next, in the words of each audience.

    ``text`` holds ``{}`` where the command goes ("start a fresh group with {}");
    ``api`` is the call for API users (``"pool.restart()"``), ``magic`` what a notebook
    user types (``"%fsdp restart"``). A ``magic`` containing ``{out}`` names the variable
    of ``%%fsdp -o NAME``; without one the step is left out for notebook users. ``None``:
    no notebook form.
    """

    text: str
    api: str
    magic: str | None = None

    def render(self, notebook: bool, out: str | None = None) -> str | None:
        if not notebook:
            return self.text.format(self.api)
        if self.magic is None or ("{out}" in self.magic and not out):
            return None
        return self.text.format(self.magic.replace("{out}", out or ""))


RESTART = Step("start a fresh group with {}", "pool.restart()", "%fsdp restart")
START = Step("call {}", "pool.start()", "%fsdp start -n 2")
INTERRUPT = Step("interrupt it with {}", "pool.interrupt()", "%fsdp interrupt")
WAIT = Step("keep waiting with {}", "err.wait()", "{out}.wait()")
TRACE = Step("compare every rank's collectives with {}", "pool.trace()", "%fsdp trace")
RECOVER = Step("go back to the last snapshot with {}", "pool.recover()", "%fsdp recover")
RUN_AGAIN = Step("{} to continue", "run the call again", "run the cell again")


def advice_line(steps: tuple[Step, ...], notebook: bool, out: str | None = None) -> str:
    """The steps as one sentence: "Keep waiting with ..., interrupt ..., or start ..."."""
    parts = [text for step in steps if (text := step.render(notebook, out))]
    if not parts:
        return ""
    sentence = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + ", or " + parts[-1]
    return sentence[0].upper() + sentence[1:] + "."


class Advised:
    """A message in three parts, the middle one naming what to do next.

    ``str(error)`` addresses API callers (``pool.restart()``);
    :meth:`notebook_message` says the same to notebook users (``%fsdp restart``); the
    magics show that one.
    """

    _head: str = ""
    _tail: str = ""
    advice: tuple[Step, ...] = ()

    def _compose(self, notebook: bool, out: str | None = None) -> str:
        line = advice_line(self.advice, notebook, out)
        return "\n".join(part for part in (self._head, line, self._tail) if part)

    @property
    def what_happened(self) -> str:
        """The message without its advice (for an error quoted inside another one)."""
        return self._head

    def notebook_message(self, out: str | None = None) -> str:
        """The message for a notebook user; ``out``: the name ``%%fsdp -o`` stored it under."""
        return self._compose(True, out)

    def recovered(self, summary: str) -> None:
        """Say that the pool recovered by itself (``Pool(recover="auto")``): ``summary``
        ("recovered to the snapshot ... in 4.1 s") joins the message, and the advice
        becomes running the call again."""
        self._head = f"{self._head}\n{summary}" if self._head else summary
        self.advice = (RUN_AGAIN,)
        self.args = (self._compose(False),)

    def recovery_failed(self, reason: str) -> None:
        """Say that an automatic recovery was tried and why it failed; the advice stays."""
        self.add_note_line(f"Automatic recovery failed: {reason}")

    def add_head_line(self, line: str) -> None:
        """Add ``line`` to what happened, before the advice."""
        self._head = f"{self._head}\n{line}" if self._head else line
        self.args = (self._compose(False),)

    def add_note_line(self, line: str) -> None:
        """Add ``line`` before the message's tail (what the ranks wrote)."""
        self._tail = f"{line}\n{self._tail}" if self._tail else line
        self.args = (self._compose(False),)

    def advise(self, *steps: Step) -> None:
        """Replace what the message names to do next with ``steps``."""
        self.advice = steps
        self.args = (self._compose(False),)


class PoolError(RuntimeError):
    """Base class of the pool's own errors that are not about one run's outcome."""


class PoolStartError(PoolError):
    """The pool could not start; everything it had started has been stopped again."""


class RecoveryError(Advised, PoolError):
    """A recovery could not bring the ranks back; the message says which phase failed and
    why, and what state the pool is left in (a fresh group, or as it was), then what to do
    (``steps``) in API calls or, in :meth:`notebook_message`, magics."""

    def __init__(self, message: str, *steps: Step):
        self._head = message
        self.advice = steps
        super().__init__(self._compose(False))


class PoolBusy(Advised, PoolError):
    """Ranks are still running an earlier call (one that timed out or was interrupted
    and did not stop); new work would queue behind it. Wait for it, interrupt it or
    restart the pool. ``ranks``: the busy ranks; ``blocked``: those of them known to be
    blocked inside a collective, which only a new group frees (recover or restart)."""

    def __init__(self, ranks: list[int], blocked: list[int] | None = None):
        self.ranks = sorted(ranks)
        self.blocked = sorted(blocked or [])
        verb = "runs" if len(self.ranks) == 1 else "run"
        self._head = (
            f"{_ranks_text(self.ranks)} still {verb} an earlier call that timed out or was "
            "interrupted; new work would wait behind it."
        )
        if self.blocked:
            self._head += "\n" + (
                f"{_ranks_text(self.blocked)} {'is' if len(self.blocked) == 1 else 'are'} "
                "blocked inside a collective: only a new group frees "
                f"{'it' if len(self.blocked) == 1 else 'them'}."
            )
            self.advice = (RECOVER, RESTART)
        else:
            self.advice = (WAIT, INTERRUPT, RESTART)
        super().__init__(self._compose(False))


class PoolNotRunning(Advised, PoolError):
    """The pool is stopped or broken (a rank died): call ``start()``, ``recover()`` or
    ``restart()``."""

    def __init__(self, message: str, *steps: Step):
        self._head = message
        self.advice = steps
        super().__init__(self._compose(False))

    def _compose(self, notebook: bool, out: str | None = None) -> str:
        line = advice_line(self.advice, notebook, out)
        return f"{self._head}; {line[0].lower()}{line[1:-1]}" if line else self._head


class RankError(Advised, RuntimeError):
    """One or more ranks raised.

    ``ranks`` lists them; ``tracebacks`` maps each to its plain-text traceback and
    ``errors`` to ``(exception type name, message)``. The message shows the lowest
    failing rank's traceback in full, names the ranks with the identical traceback and
    gives the last line of every different one, then how to look at the failing frame
    (``pool.debug(rank)`` / ``%fsdp debug -r RANK``).
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
        self._head = "\n".join(lines).rstrip("\n")
        first = self.ranks[0]
        if errors.get(first, ("",))[0] != "KeyboardInterrupt":
            self.advice = (
                Step(
                    "look at the failing frame with {}",
                    f"pool.debug({first}, 'p NAME')",
                    f"%fsdp debug -r {first}",
                ),
            )
        super().__init__(self._compose(False))


class RankTimeout(Advised, TimeoutError):
    """A run did not finish within its timeout. The ranks were NOT stopped.

    ``stacks`` maps every targeted rank to its current Python stack (text in traceback
    order, with source lines) and ``where`` to a one-line summary ("in barrier (...)").
    ``pending`` lists the ranks still running. ``collectives`` maps each rank to its
    recent collectives (:class:`pool.common._collectives.RecorderDump`) and ``diagnosis`` holds one
    line per disagreement between ranks ("rank 0 waits in barrier #12; rank 1 never
    issued #12 ..."). ``native`` maps ranks to py-spy's native frames when asked for.
    ``wait(timeout)`` keeps waiting for the same run and returns its result (or raises
    as the run would have); the other choices are ``pool.interrupt()`` and
    ``pool.restart()``.
    """

    def __init__(
        self,
        head: str,
        tail: str,
        stacks: dict[int, str],
        where: dict[int, str],
        pending: list[int],
        wait: Callable[[float | None], Any],
        *,
        collectives: dict[int, Any] | None = None,
        diagnosis: list[str] | None = None,
        native: dict[int, str] | None = None,
    ):
        self._head, self._tail = head, tail
        self.advice = (WAIT, TRACE, INTERRUPT, RECOVER, RESTART)
        super().__init__(self._compose(False))
        self.stacks = stacks
        self.where = where
        self.pending = pending
        self.collectives = collectives or {}
        self.diagnosis = list(diagnosis or [])
        self.native = native or {}
        self._wait = wait

    def wait(self, timeout: float | None = None) -> Any:
        """Keep waiting for the timed-out run (``None``: no limit)."""
        return self._wait(timeout)


class RankDied(Advised, RuntimeError):
    """One or more rank processes died. The pool tore the group down; call ``restart()``.

    ``ranks`` lists the dead ranks; ``exit_codes`` maps each to its exit status
    (negative: killed by that signal; ``None``: unknown, e.g. a remote engine);
    ``log_tails`` maps each to the lines of its engine's log written during the call it
    died in; ``reports`` to what it wrote during that call (its output and those log
    lines, or that it wrote nothing), which the message shows; ``causes`` to why it was
    killed where its host's records say (the OOM killer); ``lost_hosts`` lists hosts
    all of whose ranks vanished at once with no exit status (the host or the network to
    it is gone); ``between_calls`` is True when the ranks died while no call ran on them
    (the call that raises this never ran).
    """

    def __init__(
        self,
        ranks: list[int],
        exit_codes: dict[int, int | None],
        log_tails: dict[int, str],
        hosts: dict[int, str] | None = None,
        pids: dict[int, int] | None = None,
        lost_hosts: list[str] | None = None,
        reports: dict[int, str] | None = None,
        between_calls: bool = False,
        causes: dict[int, str] | None = None,
    ):
        self.ranks = sorted(ranks)
        self.causes = dict(causes or {})
        self.exit_codes = exit_codes
        self.log_tails = log_tails
        self.reports = dict(reports or {})
        self.lost_hosts = list(lost_hosts or [])
        self.between_calls = between_calls
        when = " while no call ran on it" if between_calls else ""
        lines = [
            f"host {host} lost: every rank on it vanished without an exit status "
            "(the host, or the network to it, is gone)"
            for host in self.lost_hosts
        ]
        for rank in self.ranks:
            where = ""
            if pids and rank in pids:
                where = f" (pid {pids[rank]}" + (f" on {hosts[rank]}" if hosts else "") + ")"
            how = describe_exit(exit_codes.get(rank))
            if rank in self.causes:
                how += f" ({self.causes[rank]})"
            lines.append(f"rank {rank}{where} died{when}: {how}")
        #: The deaths in one line ("rank 1 (pid 4242 on node7) died: killed by signal SIGKILL").
        self.summary = "; ".join(lines)
        lines.append("The process group was torn down.")
        self._head = "\n".join(lines)
        self.advice = (RECOVER, RESTART)
        tails = []
        for rank in self.ranks:
            if rank in self.reports:
                tails.append(self.reports[rank])
                continue
            tail = log_tails.get(rank, "").rstrip()
            if tail:
                tails.append(f"--- last lines of rank {rank}'s engine log ---\n{tail}")
        self._tail = "\n".join(tails)
        super().__init__(self._compose(False))


class RankInterrupted(Advised, KeyboardInterrupt):
    """A run was interrupted; SIGINT was forwarded to its ranks.

    ``ranks`` are the ranks that were signalled; ``stuck`` maps ranks that did not stop
    to a one-line description of where they are; ``needs_restart`` is True when an
    interrupt landed inside (or left a rank blocked in) a collective: a
    ``torch.distributed`` call, or an NCCL collective still unfinished on the rank's GPU
    (``unfinished`` describes those of the ranks that did stop), in which case the
    process group's state is undefined and ``pool.restart()`` is needed.
    """

    def __init__(
        self,
        ranks: list[int],
        stuck: dict[int, str],
        in_collective: list[int],
        unfinished: dict[int, str] | None = None,
    ):
        self.ranks = sorted(ranks)
        self.stuck = stuck
        self.in_collective = sorted(in_collective)
        self.unfinished = dict(unfinished or {})
        self.needs_restart = bool(in_collective)
        lines = [f"interrupted {_ranks_text(self.ranks)} (SIGINT)."]
        for rank, where in sorted(stuck.items()):
            lines.append(f"rank {rank} did not stop: {where}")
        for rank, what in sorted(self.unfinished.items()):
            lines.append(f"rank {rank} stopped but left {what} queued on its GPU")
        if self.needs_restart:
            lines.append(
                f"{_ranks_text(self.in_collective)} interrupted inside a collective "
                "(torch.distributed, or NCCL work unfinished on the GPU): the process group "
                "must be restarted; only a new group frees a rank blocked in a collective."
            )
            self.advice = (RECOVER, RESTART)
        self._head = "\n".join(lines)
        super().__init__(self._compose(False))


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
