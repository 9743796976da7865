"""A run's output as the ranks wrote it, through a real 2-rank pool: chunks with carriage
returns arrive unaltered (or, read from ipyparallel's record, as a carriage return and the
current line), and the default printer moves a progress line in place."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import pytest

from fsdp_interactive._bar_state import bar_of
from fsdp_interactive._lines import LineBuffer, final_lines, final_text
from fsdp_interactive.pool import TaggedPrinter, _output
from fsdp_interactive.pool._call_output import (
    CallOutput,
    RankDisplay,
    RankText,
    received_metadata,
)
from fsdp_interactive.pool._rendezvous import Rendezvous
from tests.notebook.gates import Gates, gated_loop

pytestmark = pytest.mark.timing

STEPS = 5


def _counter(gates: Path) -> str:
    """Each rank rewrites a counter line ``step i/5``, then waits until the test has seen
    step ``i`` from both ranks (gate ``i``): the text must come while the ranks run."""
    step = f"print(f'step {{i}}/{STEPS}', end='\\r', file=sys.stderr, flush=True)"
    return gated_loop(gates, STEPS, "RANGE", body=step, setup="import sys") + (
        "print('finished', rank, file=sys.stderr)\n"
    )


def _collect(pool, subscribe: bool, gates_dir: Path) -> dict[int, str]:
    handles = {
        rank: view.execute(_counter(gates_dir), block=False, silent=False)
        for rank, view in pool._live.views([0, 1]).items()
    }
    output = CallOutput(handles, subscribe=subscribe)
    received: dict[int, list[str]] = {0: [], 1: []}
    gates = Gates(gates_dir, STEPS)
    try:
        while not all(handle.ready() for handle in handles.values()):
            for rank, item in output.take():
                assert isinstance(item, RankText) and item.name == "stderr"
                received[rank].append(item.text)
            texts = ["".join(parts) for parts in received.values()]
            gates.observe(
                " ".join(
                    f"{i}/{STEPS}" for i in range(STEPS) if all(f"step {i}/" in t for t in texts)
                )
            )
            handles[0].wait(0.05)
    finally:
        gates.close()
    for handle in handles.values():
        handle.wait_for_output(5)
    for rank, item in output.take():
        received[rank].append(item.text)
    output.close()
    # every step came while the ranks ran, each before the ranks went on
    assert gates.opened_by_sight == list(range(STEPS)), received
    return {rank: "".join(parts) for rank, parts in received.items()}


def test_subscribed_chunks_are_the_stream_as_written(pool, tmp_path):
    texts = _collect(pool, subscribe=True, gates_dir=tmp_path)
    for rank, text in texts.items():
        assert text == "".join(f"step {i}/{STEPS}\r" for i in range(STEPS)) + f"finished {rank}\n"


def test_chunks_read_from_the_record_rewrite_the_current_line(pool, tmp_path):
    texts = _collect(pool, subscribe=False, gates_dir=tmp_path)
    for rank, text in texts.items():
        buffer = LineBuffer()
        assert buffer.feed(text) == [line for line in final_lines(text)]
        assert final_text(text) == f"finished {rank}\n"
        assert text.count("\r") >= 1  # the rewrites reached the reader as rewrites


def test_the_default_printer_moves_a_progress_line_and_ends_it_in_its_last_state(pool):
    err = io.StringIO()
    result = pool.run(
        "from tqdm import tqdm\nimport time\n"
        "for _ in tqdm(range(4), desc=f'rank {rank}', mininterval=0):\n    time.sleep(0.1)\n",
        on_output=TaggedPrinter(stdout=err, stderr=err),
    )
    transcript = err.getvalue()
    assert "\r[rank 0:stderr] rank 0:  50%|█████     | 2/4" in transcript
    shown = [line.text.rstrip() for line in final_lines(transcript) if line.text.strip()]
    assert sorted(shown) == [
        line
        for line in sorted(shown)
        if line.startswith(("[rank 0:stderr] rank 0: 100%|", "[rank 1:stderr] rank 1: 100%|"))
    ]
    assert len(shown) == 2
    assert (
        result.stderr[0].startswith("rank 0: 100%|██████████| 4/4") and "\r" not in result.stderr[0]
    )


def test_output_that_arrived_before_the_subscription_is_taken_while_the_rank_waits(pool, tmp_path):
    """A rank prints, then waits until its line has been seen; the subscription starts only
    after the line reached the client, so no message will ever call it back. take() must
    still hand the line over (once) while the rank waits."""
    marker = tmp_path / "seen"
    code = (
        "import os, time\n"
        "print('waiting', flush=True)\n"
        "deadline = time.monotonic() + 30\n"
        f"while not os.path.exists({str(marker)!r}):\n"
        "    assert time.monotonic() < deadline, 'the line was not taken'\n"
        "    time.sleep(0.05)\n"
        "print('released', flush=True)\n"
    )
    handle = pool._live.views([0])[0].execute(code, block=False, silent=False)
    deadline = time.monotonic() + 30
    while "waiting" not in (received_metadata(handle).get("stdout") or ""):
        assert time.monotonic() < deadline, "the rank's line never reached the client"
        time.sleep(0.02)
    output = CallOutput({0: handle})
    texts: list[str] = []
    while not marker.exists():
        assert time.monotonic() < deadline, f"take() never handed the line over: {texts}"
        texts += [item.text for _, item in output.take()]
        if any("waiting" in text for text in texts):
            marker.touch()
        time.sleep(0.02)
    handle.get(30)
    handle.wait_for_output(5)
    texts += [item.text for _, item in output.take()]
    output.close()
    assert "".join(texts) == "waiting\nreleased\n"


class _Displays:
    """An output sink that keeps every display a rank sent (text is dropped)."""

    def __init__(self) -> None:
        self.shown: dict[int, list[RankDisplay]] = {0: [], 1: []}

    def __call__(self, rank: int, name: str, text: str) -> None:
        pass

    def display(self, rank: int, shown: RankDisplay) -> None:
        self.shown[rank].append(shown)


def _subscribe_after(monkeypatch, line: str) -> None:
    """Hold the kernel before a call subscribes to its output until ``line`` of every
    rank's stdout reached the client (on a busy kernel every message of a short call may
    come first: the client's record keeps a display but none of its updates)."""

    class SubscribedLate(CallOutput):
        def __init__(self, handles, subscribe=True) -> None:
            deadline = time.monotonic() + 120
            while not all(
                line in (received_metadata(h).get("stdout") or "") for h in handles.values()
            ):
                assert time.monotonic() < deadline, f"the ranks' {line!r} never reached the client"
                time.sleep(0.02)
            super().__init__(handles, subscribe)

    monkeypatch.setattr(_output, "CallOutput", SubscribedLate)


SHORT_BAR = (
    "from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='short', mininterval=0):\n"
    "    pass\nprint('bar done', flush=True)\n"
)


def test_a_bar_whose_states_all_came_before_the_subscription_reaches_its_end(pool, monkeypatch):
    """A run's short ``tqdm.auto`` bar reaches its last state although all its messages
    came before the run subscribed to its output."""
    _subscribe_after(monkeypatch, "bar done")
    sink = _Displays()
    pool.run(SHORT_BAR, on_output=sink)
    for rank, displays in sink.shown.items():
        states = [bar_of(shown.data) for shown in displays]
        assert states and states[0].n == 0, (rank, states)
        assert states[-1].n == 3 and states[-1].closed, (rank, states)
        assert [shown.update for shown in displays] == [False] + [True] * (len(displays) - 1)


def _short_bar() -> str:
    from tqdm.auto import tqdm

    for _ in tqdm(range(3), desc="short", mininterval=0):
        pass
    print("bar done", flush=True)
    return "returned"


def _assert_each_bar_ended_at_3(err: str) -> None:
    """``err``, a printer's stderr, shows each rank's short bar once, at its last state."""
    for rank in (0, 1):
        bars = [
            line.text for line in final_lines(err) if line.text.startswith(f"[rank {rank}] short:")
        ]
        assert len(bars) == 1 and "| 3/3 [" in bars[0], (rank, err)


def test_a_calls_bar_whose_states_all_came_before_the_subscription_ends_in_its_last_state(
    pool, monkeypatch, capsys
):
    """The same for ``Pool.call``: its printer ends each rank's bar at 3/3, once."""
    _subscribe_after(monkeypatch, "bar done")
    assert pool.call(_short_bar) == ["returned", "returned"]
    _assert_each_bar_ended_at_3(capsys.readouterr().err)


def test_a_start_up_steps_output_is_shown_from_its_first_message(pool, monkeypatch, capsys):
    """The same for a start-up step of a pool with a log level, whose ranks' output is
    shown tagged by rank (here a step that shows a bar, on the running pool's engines)."""
    _subscribe_after(monkeypatch, "bar done")
    rendezvous = Rendezvous(
        pool._client, timeout=120, pg_timeout=600, launched=None, log_level=logging.INFO
    )
    rendezvous.gather_ranks(
        pool._live.views([0, 1]),
        lambda _, view: view.execute(SHORT_BAR, block=False, silent=False),
        "showing a bar",
    )
    _assert_each_bar_ended_at_3(capsys.readouterr().err)
