"""The live notice of a call in which some ranks wait in a collective that others never reach.

Kernel side. A cell whose rank 0 waits in ``dist.barrier()`` that rank 1 never reaches
prints nothing and keeps the kernel busy until the process group's timeout. While a call
runs, :class:`HangWatch` looks at the ranks still running it once it has run for
``after`` seconds (the threshold, 30 by default), and then about once a second: it asks
their diagnostics agents (:mod:`._agent_client`) for the user thread's stack and the
newest flight-recorder entries in one round trip, the same request a timeout's report
makes. :func:`assess` turns the answers into a :class:`HangNotice` when ranks have
waited in one collective (or a barrier) for ``after`` seconds or more while other ranks
of the call finished it, run elsewhere or wait in another collective. How long a rank
has waited comes from the flight recorder's entry of that collective (when torch issued
it), so a rank counts as waiting only where its recorder holds the collective unfinished:
a loop of collectives that progresses never shows a wait longer than one of them. With
the recorder off (``Pool(flight_recorder=0)``) there is no notice: a stack alone cannot
tell one long wait from a loop that passes the same line again and again.

The waiting loop (:mod:`pool._dispatch`) calls :meth:`HangWatch.tick` between its polls
and shows what it returns: the notice when it changed, ``None`` when it went away (the
ranks moved on). It never ends the call: that stays ``timeout=``.

Cost: nothing at all while a call is younger than ``after`` (one clock reading per poll of
the waiting loop, no thread); after it, one request per running rank whenever a wait could
cross the threshold: once a threshold while no rank waits long (a cell that trains for an
hour is looked at about 120 times at the default), once a second while a notice is shown.
A look is answered by each rank's agent thread in about a millisecond. Not a notice: every rank of the call waiting in the same collective (a slow
collective, or a wedged network: the timeout's report and ``trace()`` tell), ranks whose
agent does not answer (a thread holds the GIL in C code) when no answering rank waits, a
rank stopped at ``fsdp_interactive.breakpoint()`` (the other ranks wait for the person who
debugs it).

Faults: a rank that dies meanwhile stops answering; the waiting loop finds it dead and
ends the call as before (the watch stops with the call). A collective that wedges is what
the notice is for; it stays shown, updated, until the call ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fsdp_interactive.pool.common._collectives import (
    CollectiveRecord,
    RecorderDump,
    collective_label,
    ranks_text,
    unfinished_on_device,
)
from fsdp_interactive.pool.common._stacks import (
    Frame,
    describe,
    in_distributed,
    is_cell_file,
    location,
    user_frames,
    with_cell_sources,
)

log = logging.getLogger(__name__)

#: Seconds ranks wait in a collective others never reach before the notice shows.
DEFAULT_AFTER_S = 30.0
#: How often the ranks are looked at while a notice is shown.
POLL_S = 1.0
#: Flight-recorder entries read per look (the collective a rank waits in is among the newest).
_TRACE_ENTRIES = 16
#: An agent that does not answer within this is left out of one look.
_ASK_TIMEOUT_S = 2.0
#: The shortest pause between two looks.
_MIN_PAUSE_S = 0.1
_BREAKPOINT_FILE = "_breakpoint.py"

#: What a notice asks the reader to do, for a notebook user and for an API caller.
_NOTEBOOK_STEPS = (
    "Interrupt the kernel (the stop button, or Ctrl-C in a terminal) to stop the cell and see "
    "where every rank is, then type %fsdp trace"
)
_API_STEPS = (
    "Press Ctrl-C (interrupt the kernel) to stop the call and see where every rank is, then "
    "call pool.trace()"
)


def threshold(value: Any, name: str = "hang_notice") -> float | None:
    """The threshold ``value`` asks for: seconds (a positive number), ``True`` for the
    default, ``False`` (or ``None``) for no notice; ``ValueError`` naming ``name`` otherwise."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_AFTER_S
    if isinstance(value, int | float) and value > 0 and value != float("inf"):
        return float(value)
    raise ValueError(
        f"{name} must be a number of seconds > 0, True (the default, {DEFAULT_AFTER_S:g} s) or "
        f"False (no notice), got {value!r}"
    )


@dataclass(frozen=True)
class Waiting:
    """Ranks that wait in one collective: ``collective`` (``"barrier #4"``), the
    ``line`` that issued it (``"Cell In[7], line 3: dist.barrier()"``, ``None`` when
    unknown), the longest wait among them in ``seconds``."""

    ranks: tuple[int, ...]
    collective: str
    line: str | None
    seconds: float

    def text(self) -> str:
        verb = "has" if len(self.ranks) == 1 else "have"
        text = f"{ranks_text(self.ranks)} {verb} waited {self.seconds:.0f} s in {self.collective}"
        return text + (f" ({self.line})" if self.line else "")


@dataclass(frozen=True)
class HangNotice:
    """What a running call's notice says: the ranks that wait past the threshold
    (``waiting``), then where each other rank of the pool is (``others``: one phrase per
    set of ranks, e.g. ``((1,), "finished the cell")``)."""

    waiting: tuple[Waiting, ...]
    others: tuple[tuple[tuple[int, ...], str], ...] = ()

    #: The key of the notice's live line among a cell's moving lines: it sorts before
    #: every rank's, so that a text stream's one moving line shows the notice.
    LINE_KEY: ClassVar[tuple[int, str, str]] = (-1, "hang", "")

    @property
    def ranks(self) -> list[int]:
        """The waiting ranks."""
        return sorted(rank for group in self.waiting for rank in group.ranks)

    def text(self, notebook: bool) -> str:
        """The notice in one line, ending with what to type: magics for a notebook user
        (``notebook``), API calls otherwise."""
        parts = [group.text() for group in self.waiting]
        parts += [f"{ranks_text(ranks)} {what}" for ranks, what in self.others]
        steps = _NOTEBOOK_STEPS if notebook else _API_STEPS
        return f"possible hang: {'; '.join(parts)}. {steps}."


@dataclass(frozen=True)
class RankState:
    """One rank as a look saw it: ``key`` names the collective it waits in (``None``:
    it does not wait in one), ``seconds`` how long (``None``: unknown), ``where`` a
    phrase for a rank that does not wait; ``debugged``: it is stopped at a breakpoint."""

    rank: int
    key: tuple[Any, ...] | None = None
    collective: str = ""
    line: str | None = None
    seconds: float | None = None
    where: str = ""
    debugged: bool = False


def rank_state(
    rank: int, frames: Sequence[Frame], dump: RecorderDump | None, code: str | None
) -> RankState:
    """Where ``rank`` is, from its user frames (innermost first) and recorder ``dump``.

    Inside ``torch.distributed`` with an unfinished collective in the recorder: waiting in
    it, since the recorder says. Inside it without one (on its way in or out of a
    collective, or a wait the recorder does not record, or no recorder): running there.
    """
    if any(frame.file.endswith(_BREAKPOINT_FILE) for frame in frames):
        return RankState(rank, where="is stopped at a breakpoint", debugged=True)
    if not frames:
        return RankState(rank, where="is idle")
    line = _issuing_line(frames)
    if in_distributed(frames) is not None:
        record = _newest_unfinished(dump)
        if record is not None:
            return RankState(rank, _key(record), collective_label(record), line, record.pending_s)
    behind = unfinished_on_device(dump)
    if behind:  # NCCL: the Python thread waits for the GPU, behind this collective
        record = behind[0]
        text = f"{collective_label(record)} (unfinished on the GPU)"
        return RankState(rank, _key(record), text, line, record.pending_s)
    return RankState(rank, where=f"runs {line or describe(frames, code)}")


def assess(
    states: Mapping[int, RankState],
    *,
    after: float,
    running: Sequence[int],
    targets: Sequence[int],
    world: Sequence[int],
    noun: str = "cell",
) -> HangNotice | None:
    """The notice the ``states`` of the ``running`` ranks (those still running the call;
    a running rank missing from ``states`` did not answer) call for, else ``None``.

    ``targets``: the ranks of the call (the others are not part of it); ``world``: every
    rank of the pool; ``noun``: what the call is called ("cell").
    """
    if any(state.debugged for state in states.values()):
        return None
    groups: dict[tuple[Any, ...], list[RankState]] = {}
    for state in states.values():
        if state.key is not None:
            groups.setdefault(state.key, []).append(state)
    if len(groups) == 1 and len(next(iter(groups.values()))) == len(targets):
        return None  # every rank of the call waits in the same collective
    overdue = []
    for members in groups.values():
        waited = [s.seconds for s in members if s.seconds is not None]
        if waited and max(waited) >= after:
            first = min(members, key=lambda s: s.rank)
            overdue.append(
                Waiting(
                    tuple(sorted(s.rank for s in members)),
                    first.collective,
                    first.line,
                    max(waited),
                )
            )
    if not overdue:
        return None
    shown = {rank for group in overdue for rank in group.ranks}
    phrases: dict[str, list[int]] = {}
    for rank in world:
        if rank in shown:
            continue
        if rank not in targets:
            what = f"is not part of this {noun}"
        elif rank not in running:
            what = f"finished the {noun}"
        elif rank not in states:
            what = "did not answer its diagnostics agent"
        else:
            state = states[rank]
            if state.key is None:
                what = state.where
            else:
                what = f"waits in {state.collective}" + (f" ({state.line})" if state.line else "")
        phrases.setdefault(what, []).append(rank)
    others = tuple((tuple(ranks), _plural(what, len(ranks))) for what, ranks in phrases.items())
    return HangNotice(tuple(sorted(overdue, key=lambda w: w.ranks)), others)


class HangWatch:
    """Looks at a running call's ranks once it is ``after`` seconds old, on a thread of
    its own, and says when the notice changes.

    ``ask(ranks, request, timeout)`` asks ranks' agents (:meth:`RankAgents.ask`);
    ``targets``/``world``: the call's ranks and the pool's; ``code``/``cell``: the source
    the ranks run and its label, for cell frames that came without them; ``began``: when the call
    was sent (``time.monotonic()``).
    """

    def __init__(
        self,
        ask: Callable[[Sequence[int], dict[str, Any], float], Mapping[int, Any]],
        after: float,
        *,
        targets: Sequence[int],
        world: Sequence[int],
        began: float,
        code: str | None = None,
        cell: str | None = None,
        noun: str = "cell",
        poll_s: float = POLL_S,
    ) -> None:
        self._ask = ask
        self.after = float(after)
        self._targets = list(targets)
        self._world = list(world)
        self._began = began
        self._code = code
        self._cell = cell
        self._noun = noun
        self._poll_s = poll_s
        self._running: tuple[int, ...] = tuple(targets)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._latest: HangNotice | None = None
        self._shown: HangNotice | None = None
        self.looks = 0

    def tick(self, running: Sequence[int]) -> tuple[bool, HangNotice | None]:
        """Between the waiting loop's polls: ``running`` are the ranks still running the
        call. Returns ``(changed, notice)``: whether what should be shown changed, and
        the notice to show (``None``: none)."""
        self._running = tuple(running)
        if self._thread is None:
            if time.monotonic() - self._began < self.after:
                return False, None
            self._thread = threading.Thread(
                target=self._watch, name="fsdp-interactive-hang-watch", daemon=True
            )
            self._thread.start()
        with self._lock:
            latest = self._latest
        if latest == self._shown:
            return False, latest
        self._shown = latest
        return True, latest

    def stop(self) -> None:
        """Stop looking (a look under way ends on its own, unheard)."""
        self._stop.set()

    def _watch(self) -> None:
        pause = 0.0
        while not self._stop.wait(pause):
            began = time.monotonic()
            try:
                notice, due = self._look()
            except Exception:  # a look must never disturb the call; the next one retries
                log.debug("hang watch: a look failed", exc_info=True)
                notice, due = None, self._poll_s
            with self._lock:
                self._latest = notice
            # Never more often than the looks themselves take (a pool of many ranks).
            pause = max(due, _MIN_PAUSE_S, 2 * (time.monotonic() - began))

    def _look(self) -> tuple[HangNotice | None, float]:
        """One look: the notice it calls for, and when to look next (seconds).

        Next: when the longest wait seen would cross the threshold; with no rank waiting,
        one threshold from now (a wait that starts after this look cannot cross it
        sooner), so that a long healthy cell is looked at once a threshold; once a
        second while a notice is shown (its seconds, and the ranks moving on) or ranks
        wait past the threshold together.
        """
        running = [rank for rank in self._running if rank in self._targets]
        if not running:
            return None, self.after
        request = {"op": "stacks", "native": False, "trace": _TRACE_ENTRIES}
        replies = self._ask(running, request, _ASK_TIMEOUT_S)
        self.looks += 1
        states: dict[int, RankState] = {}
        for rank, reply in replies.items():
            user = next((t for t in reply.get("threads", ()) if t.user), None)
            frames = user_frames(user.frames) if user is not None else []
            frames = with_cell_sources(frames, self._code, self._cell)
            states[rank] = rank_state(rank, frames, reply.get("trace"), self._code)
        notice = assess(
            states,
            after=self.after,
            running=running,
            targets=self._targets,
            world=self._world,
            noun=self._noun,
        )
        waits = [s.seconds for s in states.values() if s.seconds is not None]
        due = min([self.after - w for w in waits if w < self.after], default=self.after)
        if notice is not None or any(w >= self.after for w in waits):
            due = min(due, self._poll_s)
        log.debug(
            "hang watch: look %d at ranks %s: %s",
            self.looks,
            running,
            notice.text(False) if notice is not None else "no rank waits past the threshold",
        )
        return notice, due


def _newest_unfinished(dump: RecorderDump | None) -> CollectiveRecord | None:
    """The newest collective of ``dump`` that has not completed (what the rank waits in)."""
    if dump is None or dump.note:
        return None
    unfinished = [r for r in dump.records if r.completed is False]
    return unfinished[-1] if unfinished else None


def _key(record: CollectiveRecord) -> tuple[Any, ...]:
    return ("collective", record.group, record.seq, record.op, record.p2p)


def _issuing_line(frames: Sequence[Frame]) -> str | None:
    """``Cell In[7], line 3: dist.barrier()``: the cell line the rank runs (``line 3:
    ...`` for code without a cell number), else the frame that called into
    ``torch.distributed``."""
    cell = next((f for f in frames if f.cell or is_cell_file(f.file)), None)
    if cell is None:
        outermost = in_distributed(frames)
        index = frames.index(outermost) + 1 if outermost is not None else 0
        cell = frames[index] if index < len(frames) else None
    if cell is None:
        return None
    # Code sent without a cell number (``pool.run(code)``) has no label: its line number.
    where = f"line {cell.line}" if is_cell_file(cell.file) and not cell.cell else location(cell)
    return where + (f": {cell.source}" if cell.source else "")


def _plural(what: str, count: int) -> str:
    """``"finished the cell"`` stays; ``"is idle"`` -> ``"are idle"`` for several ranks."""
    if count == 1:
        return what
    for single, several in (("is ", "are "), ("waits ", "wait "), ("runs ", "run ")):
        if what.startswith(single):
            return several + what[len(single) :]
    return what
