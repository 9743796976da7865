"""Sending calls to ranks and waiting for them: targets, busy ranks, one pending call,
and reaching the ranks' processes (liveness, signals).

:class:`PendingCall` is one call dispatched to some ranks (one ipyparallel AsyncResult
per rank). Waiting for it streams the ranks' output, arms the hang watchdog, checks
that the ranks live, and turns Ctrl-C into SIGINT for the ranks; every outcome other
than success becomes an exception of :mod:`.errors`, built by :mod:`pool.diagnostics._diagnosis`.

* Death: whenever a wait for progress runs out, the pool is asked for dead ranks (an
  engine that left the controller, whose nanny reports an exit at once, or a local
  engine process that ended); any found make the pool tear the group down and raise.
  The call first notes each rank's part of it (its request and what it printed), so
  that the report tells what the dead ranks wrote during this call and nothing older.
* Timeout: the ranks are not stopped; the error carries their stacks and a ``wait``
  that resumes this same wait.
* Interrupt: engines run in their own session, so a notebook interrupt reaches only
  the kernel; the call forwards SIGINT to the ranks still running it, waits
  ``interrupt_grace`` seconds, and reports ranks that did not stop, with where they are.
* Hang notice: once the call is ``hang_after`` seconds old, a :class:`HangWatch` looks at
  the ranks still running it; while some wait in a collective others never reach, the
  sink's ``hang(notice)`` shows a live notice (``hang(None)`` takes it away), or, for a
  sink without that method, a moving line on stderr. It never ends the call.
* Debugger prompts: a rank stopped at ``fsdp_interactive.breakpoint()`` sends its
  prompt over its agent's event link; the waiting loop shows the debugger's output,
  asks the user with ``input()`` (in a notebook: the input box, through the kernel's
  stdin channel) and sends the command back. Time spent at the prompt does not count
  against the call's timeout, nor against NCCL's watchdog: every rank holds its clock
  while the user is asked (:mod:`pool.rank._watchdog_hold`).

Calls that timed out or were interrupted but still run are remembered
(:class:`Unfinished`), so new work is refused instead of queueing silently behind them.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from fsdp_interactive._lines import final_text
from fsdp_interactive.pool._name_advice import advise_push
from fsdp_interactive.pool._output import OutputPump, OutputSink, TaggedPrinter, received_metadata
from fsdp_interactive.pool.common._topology import RankRecord
from fsdp_interactive.pool.diagnostics._death_report import CallRecord
from fsdp_interactive.pool.diagnostics._diagnosis import (
    Diagnosis,
    interrupted_on_ranks,
    traceback_text,
)
from fsdp_interactive.pool.diagnostics._hang_watch import HangNotice, HangWatch
from fsdp_interactive.pool.errors import PoolBusy, RankError, strip_ansi

log = logging.getLogger(__name__)

_POLL_S = 0.05
_OUTPUT_GRACE_S = 2.0
#: The watchdog hold every rank keeps while the user is asked for a debugger command, and
#: when it lapses if the kernel never releases it (a kernel that died mid-prompt).
PROMPT_HOLD = "debugger prompt"
PROMPT_HOLD_S = 6 * 3600.0

Targets = int | Sequence[int] | str | None


def resolve_targets(targets: Targets, world_size: int) -> list[int]:
    """``targets`` (a rank, ranks, ``"all"`` or ``None``) as a sorted list of ranks."""
    if targets is None or targets == "all":
        return list(range(world_size))
    if isinstance(targets, bool | str):
        raise ValueError(f"targets must be a rank, a list of ranks or 'all', got {targets!r}")
    chosen = [targets] if isinstance(targets, int) else list(targets)
    bad = [
        t
        for t in chosen
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < world_size
    ]
    if bad or not chosen:
        raise ValueError(
            f"targets must be ranks in 0..{world_size - 1} (or 'all'), got {targets!r}"
        )
    return sorted(set(chosen))


def check_timeout(timeout: Any) -> None:
    if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


class Unfinished:
    """Per-rank handles of calls that timed out or were interrupted but still run, and
    which of those ranks are known to be blocked inside a collective."""

    def __init__(self) -> None:
        self._handles: dict[int, list[Any]] = {}
        self.blocked: set[int] = set()

    def remember(self, handles: Mapping[int, Any]) -> None:
        for rank, handle in handles.items():
            if not handle.ready():
                self._handles.setdefault(rank, []).append(handle)

    def busy_ranks(self) -> list[int]:
        """Ranks with such a call still running."""
        self._handles = {
            rank: [h for h in handles if not h.ready()] for rank, handles in self._handles.items()
        }
        busy = sorted(rank for rank, handles in self._handles.items() if handles)
        self.blocked &= set(busy)
        return busy

    def handles(self, rank: int) -> list[Any]:
        return list(self._handles.get(rank, []))

    def refuse_if_busy(self) -> None:
        """Raise :class:`PoolBusy` when any rank still runs such a call."""
        busy = self.busy_ranks()
        if busy:
            raise PoolBusy(busy, sorted(self.blocked))

    def clear(self) -> None:
        self._handles = {}
        self.blocked = set()


@dataclass(frozen=True)
class RankWatch:
    """What a pending call needs of the pool while it waits.

    ``dead_ranks()`` lists ranks whose process is gone; ``fail_dead(ranks)`` tears the
    group down and raises :class:`~.errors.RankDied`, whose report tells what each rank
    wrote during the call last given to ``note_call(records)``; ``signal(ranks, sig)`` reaches
    ranks through their nannies; ``needs_restart()`` marks the group as one that an
    interrupt left in an undefined state; ``purge(handles)`` drops the client's cached
    results.
    """

    dead_ranks: Callable[[], list[int]]
    fail_dead: Callable[[list[int]], NoReturn]
    note_call: Callable[[Mapping[int, CallRecord]], None]
    signal: Callable[[list[int], int], None]
    diagnosis: Diagnosis
    unfinished: Unfinished
    needs_restart: Callable[[], None]
    purge: Callable[[list[Any]], None]
    interrupt_grace: float


def ask_user(prompt: str) -> str:
    """``input(prompt)`` as the running shell provides it (a notebook's input box in a
    Jupyter kernel, which replaces ``builtins.input`` while a cell runs)."""
    return builtins.input(prompt)


class PendingCall:
    """One call dispatched to ranks, to be waited for once (or again after a timeout).

    ``handles`` maps rank -> single-engine AsyncResult, in rank order. ``stream``: pass
    output to ``on_output(rank, stream, text)`` while the ranks run (default: print it
    tagged ``[rank N]``). ``code``: the cell source, quoted in stack summaries;
    ``cell``: its label ("Cell In[15]"). ``native``: a timeout's report adds py-spy's
    native frames. ``finish``: turns the per-rank results into the value :meth:`wait`
    returns. ``prompt(text)``: how a debugger prompt asks the user (default:
    :func:`ask_user`). ``hang_after``: seconds after which ranks that wait in a collective
    others never reach are shown in a live notice (``None``: no notice).
    ``on_interrupt(ranks)``: what the first Ctrl-C does instead of interrupting (a script
    run asks the ranks still running to pause at their next optimizer step, and the wait
    goes on); a second Ctrl-C interrupts.
    """

    def __init__(
        self,
        handles: dict[int, Any],
        *,
        watch: RankWatch,
        stream: bool = False,
        on_output: OutputSink | None = None,
        code: str | None = None,
        cell: str | None = None,
        native: bool = False,
        finish: Callable[[list[Any]], Any] | None = None,
        prompt: Callable[[str], str] | None = None,
        hang_after: float | None = None,
        on_interrupt: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.handles = handles
        self._on_interrupt = on_interrupt
        self._end: float | None = None
        self._sent = time.monotonic()
        self._hang_after = hang_after
        self._hang: HangWatch | None = None
        self._watch = watch
        self._code = code
        self._cell = cell
        self._native = native
        self._finish = finish
        self._prompt = prompt or ask_user
        self._printer = TaggedPrinter() if stream and on_output is None else None
        sink = on_output or self._printer
        self._pump: Callable[[], None] = _nothing
        self._output: OutputPump | None = None
        if stream and sink is not None:
            self._output = self._pump = OutputPump(handles, sink)
        self._show_hang: Callable[[HangNotice | None], None] | None = getattr(sink, "hang", None)
        self._hang_line: TaggedPrinter | None = None  # where a sink without hang() shows it
        self._hang_shown = False

    def pending_ranks(self) -> list[int]:
        return [rank for rank, handle in self.handles.items() if not handle.ready()]

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for every rank, up to ``timeout`` seconds (``None``: no limit).

        Returns ``finish(per-rank results)`` (the plain list without ``finish``). Raises
        RankTimeout, RankDied, RankInterrupted or RankError.
        """
        self._end = None if timeout is None else time.monotonic() + timeout
        self._hang = self._new_hang_watch()
        try:
            while True:
                try:
                    if not self._wait_a_little(timeout):
                        break
                except KeyboardInterrupt:
                    if self._on_interrupt is None:
                        raise
                    first, self._on_interrupt = self._on_interrupt, None
                    first(self.pending_ranks())
            for handle in self.handles.values():
                # stream messages may trail the reply; wait for them briefly
                handle.wait_for_output(_OUTPUT_GRACE_S)
            self._pump()
        except KeyboardInterrupt:
            self._interrupted()
        finally:
            self._end_hang_watch()
            if self._printer is not None:
                self._printer.flush()
            if self._output is not None and not self.pending_ranks():
                self._output.close()
        results = self._collect()
        value = self._finish(results) if self._finish is not None else results
        # Results are handed over once: drop the client's cached copies (tensors pulled
        # every step would otherwise accumulate in the kernel).
        self._watch.purge(list(self.handles.values()))
        return value

    def _wait_a_little(self, timeout: float | None) -> bool:
        """One round of :meth:`wait`: pass on output, the hang notice and prompts, check the
        deadline, wait briefly for the first pending rank, check liveness; False once no
        rank is pending."""
        pending = self.pending_ranks()
        self._pump()
        if not pending:
            return False
        if self._hang is not None:
            self._hang_notice(*self._hang.tick(pending))
        prompted = self._serve_prompts()
        if self._end is not None:
            self._end += prompted
        if self._end is not None and time.monotonic() > self._end:
            self._watch.unfinished.remember(self.handles)
            raise self._watch.diagnosis.timeout_error(
                pending,
                f"{timeout:g}s",
                self._code,
                self.wait,
                cell=self._cell,
                native=self._native,
                targets=list(self.handles),
            )
        self.handles[pending[0]].wait(_POLL_S)
        if self.handles[pending[0]].ready():
            return True  # progress: liveness is checked only when a wait ran out
        dead = self._watch.dead_ranks()
        if dead:
            self._fail_dead(dead)
        return True

    def _new_hang_watch(self) -> HangWatch | None:
        if self._hang_after is None:
            return None
        diagnosis = self._watch.diagnosis
        return HangWatch(
            diagnosis.agents.ask,
            self._hang_after,
            targets=list(self.handles),
            world=diagnosis.ranks,
            began=self._sent,
            code=self._code,
            cell=self._cell,
            noun="cell" if self._code is not None else "call",
        )

    def _hang_notice(self, changed: bool, notice: HangNotice | None) -> None:
        """Show ``notice`` (``None``: take the one shown away) when it ``changed``."""
        if not changed or (notice is None and not self._hang_shown):
            return
        if self._show_hang is None:
            if self._hang_line is None:
                self._hang_line = TaggedPrinter()
            self._show_hang = self._hang_line.hang
        self._hang_shown = notice is not None
        self._show_hang(notice)

    def _end_hang_watch(self) -> None:
        """The call ended (or is being interrupted): stop looking, take the notice away."""
        if self._hang is not None:
            self._hang.stop()
            self._hang = None
        self._hang_notice(True, None)

    def _serve_prompts(self) -> float:
        """Answer the debugger prompts ranks sent; the seconds spent waiting for the user."""
        prompts = self._watch.diagnosis.agents.prompts()
        if not prompts:
            return 0.0
        began = time.monotonic()
        for message in prompts:
            self._pump()
            if self._printer is not None:
                self._printer.flush()
            output = str(message.get("output", ""))
            if output:
                sys.stdout.write(output if output.endswith("\n") else output + "\n")
                sys.stdout.flush()
            if message.get("kind") != "prompt":
                continue
            rank = int(message["rank"])
            agents = self._watch.diagnosis.agents
            agents.hold_watchdogs(PROMPT_HOLD, PROMPT_HOLD_S)
            try:
                command = self._prompt(str(message.get("prompt", f"(rank {rank} Pdb) ")))
            except EOFError:
                command = "continue"
            except KeyboardInterrupt:
                self._watch.diagnosis.agents.answer(rank, "continue")
                raise
            except Exception as error:  # no input box here (e.g. a notebook run unattended)
                print(
                    f"(no input available here ({type(error).__name__}): rank {rank} continues; "
                    "fsdp_interactive.breakpoint(..., commands=[...]) runs commands unattended)",
                    file=sys.stderr,
                    flush=True,
                )
                command = "continue"
            finally:
                agents.hold_watchdogs(PROMPT_HOLD, 0)
            self._watch.diagnosis.agents.answer(rank, command)
        return time.monotonic() - began

    def _interrupted(self) -> NoReturn:
        """Ctrl-C while waiting: forward SIGINT, wait for the ranks to stop, report."""
        watch = self._watch
        self._end_hang_watch()
        signalled = self.pending_ranks()
        log.debug("Ctrl-C: forwarding SIGINT to ranks %s", signalled)
        watch.signal(signalled, signal.SIGINT)
        end = time.monotonic() + watch.interrupt_grace
        while time.monotonic() < end and self.pending_ranks():
            self._pump()
            if watch.dead_ranks():
                break
            time.sleep(_POLL_S)
        self._pump()
        dead = watch.dead_ranks()
        if dead:
            self._fail_dead(dead)
        error = watch.diagnosis.interrupt_error(signalled, self.handles, self._code)
        if error.needs_restart:
            watch.needs_restart()
        watch.unfinished.remember(self.handles)
        watch.unfinished.blocked |= set(error.in_collective) & set(error.stuck)
        raise error from None

    def _fail_dead(self, dead: list[int]) -> NoReturn:
        """Note each rank's part of this call, then have the pool report ``dead``."""
        records = {}
        for rank, handle in self.handles.items():
            received = received_metadata(handle)
            printed = "".join(
                _ended(final_text(received.get(name) or "")) for name in ("stdout", "stderr")
            )
            records[rank] = CallRecord(request=str(handle.msg_ids[0]), output=printed)
        self._watch.note_call(records)
        self._watch.fail_dead(dead)

    def _collect(self) -> list[Any]:
        """Per-rank results in rank order, or the error the ranks' outcomes amount to."""
        import ipyparallel as ipp

        results: list[Any] = []
        tracebacks: dict[int, str] = {}
        errors: dict[int, tuple[str, str]] = {}
        died: list[int] = []
        for rank, handle in self.handles.items():
            try:
                results.append(handle.get(0))
            except ipp.error.EngineError:
                died.append(rank)
            except ipp.error.RemoteError as exc:
                if exc.ename == "EngineError":
                    died.append(rank)
                    continue
                tracebacks[rank] = traceback_text(exc)
                errors[rank] = (exc.ename, strip_ansi(str(exc.evalue)))
            except Exception as exc:
                tracebacks[rank] = traceback_text(exc)
                errors[rank] = (type(exc).__name__, str(exc))
        if died:
            self._fail_dead(died)
        if tracebacks and all(errors[r][0] == "KeyboardInterrupt" for r in tracebacks):
            error = interrupted_on_ranks(
                tracebacks, self._watch.diagnosis.unfinished_collectives(sorted(tracebacks))
            )
            if error.needs_restart:
                self._watch.needs_restart()
            raise error
        if tracebacks:
            raise advise_push(RankError(tracebacks, errors))
        return results


def dead_ranks(
    client: Any, records: Sequence[RankRecord], engine_of: Callable[[int], Any]
) -> list[int]:
    """Ranks whose engine left the controller (its nanny reports an exit at once) or
    whose process ended; ``engine_of(pid)`` gives the pool's
    :class:`pool.processes._launched.EngineProcess` for a pid (``None``: not started by the pool)."""
    registered = set(client.ids)
    dead = []
    for record in records:
        engine = engine_of(record.pid)
        unregistered = record.engine_id not in registered
        exited = engine is not None and not engine.alive()
        if unregistered or exited:
            log.debug(
                "rank %d (pid %d) is dead: %s",
                record.rank,
                record.pid,
                "its process ended" if exited else "its engine left the controller",
            )
            dead.append(record.rank)
    return dead


def signal_ranks(
    client: Any,
    records: Sequence[RankRecord],
    ranks: list[int],
    sig: int,
    engine_of: Callable[[int], Any],
) -> None:
    """Signal ``ranks`` through their engines' nannies; if that fails, through the
    launchers of the engines the pool started (``engine_of``, as for :func:`dead_ranks`)."""
    engine_ids = [records[rank].engine_id for rank in ranks]
    try:
        client.send_signal(int(sig), targets=engine_ids, block=False).result(5)
    except Exception:
        log.debug("signal %d through the nannies failed; using the launchers", sig)
        for rank in ranks:
            engine = engine_of(records[rank].pid)
            if engine is not None:
                engine.signal(sig)


def purge_results(client: Any, handles: list[Any]) -> None:
    """Drop ``handles``' results from the client's cache (nothing if that fails)."""
    with contextlib.suppress(Exception):
        client.purge_local_results(jobs=handles)


def _nothing() -> None:
    return None


def _ended(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"
