"""What a start shows while it runs, written to a terminal-like stream that stamps each
write with its time: the first line right after the call, then the phases in order, on
one line of stderr rewritten in place, ending as the summary line (on a pipe: only the
summary line, and stdout untouched); and the warning for more CPU
ranks than cores, which does not stop the start."""

from __future__ import annotations

import io
import sys
import time

import pytest

from fsdp_interactive.pool import Pool, _placement
from fsdp_interactive.pool._placement import Placement, oversubscription

#: The phases of a 2-rank start as its moving line shows them, in this order.
PHASES = (
    "starting 2 CPU ranks: starting the controller",
    "starting 2 CPU ranks: controller up ",
    "engines 0/2 registered",
    "engines 2/2 registered",
    "forming the group",
    "started 2 CPU ranks in ",
)


class StampedStream(io.StringIO):
    """A text stream that keeps each write with the ``time.monotonic()`` it came at."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.writes.append((time.monotonic(), text))
        return super().write(text)

    def isatty(self) -> bool:
        return True


def _first_at(writes: list[tuple[float, str]], text: str) -> int:
    for index, (_, written) in enumerate(writes):
        if text in written:
            return index
    raise AssertionError(f"{text!r} was never written: {[w for _, w in writes]}")


@pytest.mark.timing
def test_a_start_shows_its_phases_from_its_first_second_in_order(pool: Pool, monkeypatch):
    stream = StampedStream()
    monkeypatch.setattr(sys, "stderr", stream)
    called = time.monotonic()
    pool.restart()
    writes = stream.writes
    assert writes, "the start wrote nothing"
    first_at, first = writes[0]
    assert PHASES[0] in first, writes
    assert first_at - called < 1.0, f"the first line came {first_at - called:.2f}s after the call"
    order = [_first_at(writes, phase) for phase in PHASES]
    assert order == sorted(order), writes
    # One line moving in place: every phase is a rewrite of it, the summary ends it.
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n"), repr(text)
    summary = text.rsplit("\r", 1)[-1]
    assert summary.startswith("started 2 CPU ranks in ")
    assert "controller up" in summary and "engines registered" in summary
    assert "group formed" in summary


def test_more_cpu_ranks_than_cores_warn_with_the_numbers_and_how_to_silence_it(monkeypatch):
    monkeypatch.delenv(_placement.OVERSUBSCRIBE_ENV, raising=False)
    placement = Placement(64, None, "gloo")
    warning = oversubscription(placement, local_engines=True, allowed=False, cores=2)
    assert warning is not None
    assert warning.startswith("64 CPU ranks on 2 cores")
    for way in ("%fsdp start --oversubscribe", "oversubscribe=True", "FSDPI_OVERSUBSCRIBE=1"):
        assert way in warning
    assert oversubscription(placement, local_engines=True, allowed=True, cores=2) is None
    assert (
        oversubscription(Placement(2, None, "gloo"), local_engines=True, allowed=False, cores=2)
        is None
    )
    assert oversubscription(placement, local_engines=False, allowed=False, cores=2) is None
    monkeypatch.setenv(_placement.OVERSUBSCRIBE_ENV, "1")
    assert oversubscription(placement, local_engines=True, allowed=False, cores=2) is None


def test_an_oversubscribed_start_warns_and_starts(pool: Pool, monkeypatch, capsys):
    monkeypatch.delenv(_placement.OVERSUBSCRIBE_ENV, raising=False)
    monkeypatch.setattr(_placement, "usable_cores", lambda: 1)
    pool.restart()
    err = capsys.readouterr().err
    assert "warning: 2 CPU ranks on 1 core:" in err, err
    assert pool.running and pool.world_size == 2
    pool.oversubscribe = True
    try:
        pool.restart()
    finally:
        pool.oversubscribe = False
    assert "CPU ranks on" not in capsys.readouterr().err
