"""The death report's reading of an engine log: only what was written since the engine
took the call that died (fed by hand: ipyparallel's log format as its engine writes it)."""

from __future__ import annotations

from fsdp_interactive._engine_parent import exit_line
from fsdp_interactive.pool.diagnostics._death_report import (
    CallRecord,
    death_report,
    log_during,
)

REQUEST = "74dd79ff-a42cee7ea7418354274419c8_27335_13"
LOG = f"""\
2026-12-05 08:06:05.860 [IPEngine.1] Completed registration with id 1
2026-12-05 08:06:07.359 [IPEngine.1] Handling execute_request: 74dd79ff-a42cee7ea7418354274419c8_27335_11
2026-12-05 08:06:07.481 [IPEngine.1] Exception in execute request:
ValueError                                Traceback (most recent call last)
----> 1 if rank == 1: raise ValueError('boom')
ValueError: boom
2026-12-05 08:06:07.482 [IPEngine.1] Aborting queue
2026-12-05 08:06:07.489 [IPEngine.1] Finishing abort
2026-12-05 08:06:07.490 [IPEngine.1] Handling execute_request: {REQUEST}
written by C++ code on fd 2
2026-12-05 08:06:09.174 [KernelNanny.1] Pipe closed, parent 3579 has status: zombie
2026-12-05 08:06:09.174 [KernelNanny.1] Notifying Hub that our parent has shut down
{exit_line(3579, "hostb", -9)}
"""


def test_the_log_is_read_from_the_line_on_which_the_engine_took_the_call():
    logged = log_during(LOG, REQUEST)
    assert logged.began is True
    assert logged.text == "written by C++ code on fd 2"


def test_a_crash_report_is_kept_from_its_first_line():
    crash = "Fatal Python error: Segmentation fault\n\nThread 0x01 (most recent call first):\n"
    frames = "".join(f'  File "model.py", line {n} in forward\n' for n in range(30))
    logged = log_during(LOG + crash + frames, REQUEST, limit=5)
    assert logged.text.startswith("Fatal Python error: Segmentation fault")
    assert len(logged.text.splitlines()) == 15


def test_an_engine_that_never_took_the_call_shows_only_a_crash_report():
    assert log_during(LOG, "another-request") == log_during(LOG, None)
    assert log_during(LOG, "another-request").began is False
    assert log_during(LOG, "another-request").text == ""
    assert log_during("", REQUEST).began is None


def test_the_report_says_what_the_rank_printed_and_logged_or_that_it_wrote_nothing():
    record = CallRecord(REQUEST, output="epoch 1\n\rbar 10%\rbar 40%\n")
    text = death_report(1, record, log_during(LOG, REQUEST))
    assert text == (
        "--- what rank 1 printed during this call ---\nepoch 1\nbar 40%\n"
        "--- rank 1's engine log during this call ---\nwritten by C++ code on fd 2"
    )
    quiet = LOG.replace("written by C++ code on fd 2\n", "")
    assert death_report(1, CallRecord(REQUEST), log_during(quiet, REQUEST)) == (
        "--- rank 1 wrote nothing during this call ---"
    )
    assert death_report(1, CallRecord(REQUEST), log_during(quiet, "never-taken")) == (
        "--- rank 1 wrote nothing during this call: its engine log has no line from it ---"
    )
    assert (
        death_report(2, None, log_during(quiet, None)) == "--- rank 2 was not part of this call ---"
    )
