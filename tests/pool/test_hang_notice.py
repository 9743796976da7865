"""The live hang notice of a running call: rank 0 waits in a barrier that rank 1 never
reaches, on the shared real 2-rank pool, and what the notice says of plain records.

The ranks wait at gates (files) that the test's sink opens once it has seen what it waits
for (the notice, then its end); a fallback opens them after two minutes so that a cell
always ends, and the test then finds a gate its observations did not open.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import pytest

from fsdp_interactive.pool import HangNotice, Pool
from fsdp_interactive.pool.common._collectives import CollectiveRecord, RecorderDump
from fsdp_interactive.pool.common._stacks import Frame
from fsdp_interactive.pool.diagnostics._hang_watch import (
    Waiting,
    assess,
    rank_state,
    threshold,
)
from tests.notebook.gates import held_until, one_sided_barrier, stderr_opening

THRESHOLD_S = 2.0
_WATCH_LOG = "fsdp_interactive.pool.diagnostics._hang_watch"


class NoticeSink:
    """``on_output`` that records every notice shown, opening ``gates[i]`` when the
    ``i``-th change arrives (``opened`` lists the gates opened by sight)."""

    def __init__(self, gates: list[Path]) -> None:
        self.gates = gates
        self.notices: list[HangNotice | None] = []
        self.opened: list[int] = []
        self._fallback = threading.Timer(120, self.open_all)
        self._fallback.daemon = True
        self._fallback.start()

    def __call__(self, rank: int, name: str, text: str) -> None:
        pass

    def hang(self, notice: HangNotice | None) -> None:
        self.notices.append(notice)
        step = len(self.notices) - 1
        if step < len(self.gates):
            self.opened.append(step)
            self.gates[step].touch()

    def open_all(self) -> None:
        for gate in self.gates:
            gate.touch()

    def close(self) -> None:
        self._fallback.cancel()
        self.open_all()


@pytest.mark.timing
def test_a_barrier_one_rank_never_reaches_gets_a_notice_that_goes_when_they_move_on(
    pool: Pool, marker_dir: Path
):
    arrive, released = marker_dir / "arrive", marker_dir / "released"
    code = one_sided_barrier(arrive, then=held_until(released))
    sink = NoticeSink([arrive, released])
    try:
        pool.run(code, on_output=sink, cell=31, hang_notice=THRESHOLD_S)
    finally:
        sink.close()
    # The notice came (opening ``arrive``), then went while rank 0 still ran (opening
    # ``released``): it went because the ranks moved on, not because the cell ended.
    assert sink.opened == [0, 1], sink.notices
    notice, gone = sink.notices[:2]
    assert gone is None and notice is not None
    [waiting] = notice.waiting
    assert waiting.ranks == (0,) and waiting.collective.startswith("barrier #")
    assert waiting.line == "Cell In[31], line 8: dist.barrier()"
    assert THRESHOLD_S <= waiting.seconds <= THRESHOLD_S + 2
    assert notice.others == (((1,), "finished the cell"),)
    text = notice.text(notebook=False)
    assert text.startswith(f"possible hang: rank 0 has waited {waiting.seconds:.0f} s in barrier #")
    assert "rank 1 finished the cell" in text and "pool.trace()" in text and "Ctrl-C" in text
    assert "%fsdp trace" in notice.text(notebook=True)


@pytest.mark.timing
def test_a_slow_but_progressing_collective_loop_gets_no_notice(
    pool: Pool, marker_dir: Path, caplog
):
    # Rank 1 is slow before every all_reduce, so rank 0 waits in each for a while; the
    # loop runs until the watch has looked at the ranks five times.
    stop = marker_dir / "stop"
    looks = []

    class Looks(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("hang watch: look "):
                looks.append(record.getMessage())
                if len(looks) >= 5:
                    stop.touch()

    handler = Looks()
    logger = logging.getLogger(_WATCH_LOG)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    fallback = threading.Timer(120, stop.touch)
    fallback.start()
    code = (
        "import os, time\n"
        "steps = 0\n"
        "while True:\n"
        "    if rank == 1:\n"
        "        time.sleep(0.1)\n"
        f"    stop = torch.tensor([float(os.path.exists({str(stop)!r}))])\n"
        "    dist.all_reduce(stop)  # every rank agrees when to stop\n"
        "    steps += 1\n"
        "    if stop.item():\n"
        "        break\n"
    )
    sink = NoticeSink([])
    try:
        pool.run(code, on_output=sink, hang_notice=1.0)
    finally:
        fallback.cancel()
        stop.touch()
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert len(looks) >= 5, "the loop ended before the watch looked five times"
    assert all("no rank waits past the threshold" in look for look in looks), looks
    assert sink.notices == []
    assert min(pool.pull("steps")) >= 5


@pytest.mark.timing
def test_the_pools_threshold_applies_and_false_turns_the_notice_off(
    pool: Pool, marker_dir: Path, caplog
):
    caplog.set_level(logging.DEBUG, logger=_WATCH_LOG)
    # Off for one run while the pool's threshold is short: rank 1 arrives once rank 0 has
    # waited three thresholds (the only wait here: nothing is shown to open a gate), and
    # the watch never looked.
    pool.hang_notice = 0.5
    try:
        late = "import time\nif rank == 1:\n    time.sleep(1.5)\ndist.barrier()\n"
        quiet = NoticeSink([])
        pool.run(late, on_output=quiet, hang_notice=False)
        assert quiet.notices == []
        assert not [r for r in caplog.records if r.getMessage().startswith("hang watch: look")]
        # The pool's own threshold, without a per-call one: the notice comes.
        arrive = marker_dir / "arrive"
        sink = NoticeSink([arrive])
        try:
            pool.run(one_sided_barrier(arrive), on_output=sink)
        finally:
            sink.close()
        assert sink.opened == [0]
        assert sink.notices[0] is not None and sink.notices[0].ranks == [0]
    finally:
        pool.hang_notice = 30.0


@pytest.mark.timing
def test_a_notice_for_a_sink_without_hang_is_a_moving_line_on_stderr(pool: Pool, marker_dir: Path):
    # A plain function as on_output has no hang(): the notice moves on stderr's last line
    # (a carriage return before it), in API words, and is erased when the call ends.
    arrive = marker_dir / "arrive"
    with stderr_opening(arrive, "possible hang") as stderr:
        pool.run(one_sided_barrier(arrive), on_output=lambda *_: None, hang_notice=1.0)
    err = stderr.getvalue()
    assert "\rpossible hang: rank 0 has waited" in err
    assert "(line 8: dist.barrier()); rank 1 finished the cell" in err
    assert "call pool.trace()" in err
    assert re.search(r"\r {100,}\r$", err), f"the notice was not erased: {err[-200:]!r}"


# ---------------------------------------------------------------- plain records


def _record(seq: int, op: str = "barrier", *, completed: bool, pending_s: float | None = None):
    return CollectiveRecord(
        group="0",
        group_desc="default_pg",
        seq=seq,
        op=op,
        backend="gloo",
        completed=completed,
        pending_s=pending_s,
    )


_IN_BARRIER = [
    Frame("/site/torch/distributed/distributed_c10d.py", 4881, "barrier"),
    Frame("/tmp/ipykernel_1/123.py", 3, "<module>", "dist.barrier()", "Cell In[5]"),
]
_SLEEPING = [
    Frame("/usr/lib/python3.11/time.py", 1, "sleep"),
    Frame("/tmp/ipykernel_1/123.py", 5, "<module>", "time.sleep(9)", "Cell In[5]"),
]


def test_a_rank_in_a_barrier_past_the_threshold_while_another_runs_elsewhere_is_named():
    dump = RecorderDump((_record(4, completed=True), _record(5, completed=False, pending_s=31)))
    states = {
        0: rank_state(0, _IN_BARRIER, dump, None),
        1: rank_state(1, _SLEEPING, RecorderDump((_record(4, completed=True),)), None),
    }
    notice = assess(states, after=30, running=[0, 1], targets=[0, 1, 2], world=[0, 1, 2, 3])
    assert notice == HangNotice(
        (Waiting((0,), "barrier #5", "Cell In[5], line 3: dist.barrier()", 31.0),),
        (
            ((1,), "runs Cell In[5], line 5: time.sleep(9)"),
            ((2,), "finished the cell"),
            ((3,), "is not part of this cell"),
        ),
    )
    assert notice.text(notebook=True) == (
        "possible hang: rank 0 has waited 31 s in barrier #5 (Cell In[5], line 3: "
        "dist.barrier()); rank 1 runs Cell In[5], line 5: time.sleep(9); rank 2 finished the "
        "cell; rank 3 is not part of this cell. Interrupt the kernel (the stop button, or "
        "Ctrl-C in a terminal) to stop the cell and see where every rank is, then type "
        "%fsdp trace."
    )
    # Below the threshold, or every rank of the call in the same collective: no notice.
    assert assess(states, after=32, running=[0, 1], targets=[0, 1], world=[0, 1]) is None
    both = {rank: rank_state(rank, _IN_BARRIER, dump, None) for rank in (0, 1)}
    assert assess(both, after=30, running=[0, 1], targets=[0, 1], world=[0, 1]) is None


def test_a_rank_at_a_breakpoint_holds_back_the_notice():
    dump = RecorderDump((_record(5, completed=False, pending_s=99),))
    stopped = [Frame("/pkg/fsdp_interactive/pool/rank/_breakpoint.py", 80, "breakpoint")]
    states = {0: rank_state(0, _IN_BARRIER, dump, None), 1: rank_state(1, stopped, None, None)}
    assert assess(states, after=30, running=[0, 1], targets=[0, 1], world=[0, 1]) is None


@pytest.mark.parametrize(
    ("value", "expected"), [(True, 30.0), (False, None), (None, None), (5, 5.0), (0.5, 0.5)]
)
def test_the_threshold_is_seconds_true_or_false(value, expected):
    assert threshold(value) == expected


@pytest.mark.parametrize("value", [0, -1, "30", float("inf"), float("nan")])
def test_a_bad_threshold_is_refused_naming_the_argument(value):
    with pytest.raises(ValueError, match="hang_notice must be a number of seconds > 0"):
        threshold(value)
    with pytest.raises(ValueError, match="hang_notice must be"):
        Pool(n=2, devices="cpu", hang_notice=value)
