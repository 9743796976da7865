"""Pure-logic parts of the pool: rank assignment, stacks, error text, output tagging."""

from __future__ import annotations

import io

import pytest

from fsdp_interactive._bar_state import MIME, BarState
from fsdp_interactive._lines import final_lines
from fsdp_interactive.pool import RankDied, RankDisplay, RankError, RankInterrupted, TaggedPrinter
from fsdp_interactive.pool.common._stacks import describe, in_distributed, user_stack
from fsdp_interactive.pool.common._topology import RankRecord, assign_ranks, format_table
from fsdp_interactive.pool.errors import collapse, describe_exit
from fsdp_interactive.pool.processes._devices import _count, cuda_build


def _engine(host: str, pid: int) -> dict:
    return {"host": host, "address": f"10.0.0.{pid % 250}", "pid": pid}


def test_ranks_are_contiguous_per_host_and_local_rank_counts_within_host():
    engines = {3: _engine("b", 13), 0: _engine("a", 10), 1: _engine("b", 11), 2: _engine("a", 12)}
    slots = assign_ranks(engines)
    assert [(s.rank, s.engine_id, s.host, s.local_rank) for s in slots] == [
        (0, 0, "a", 0),
        (1, 2, "a", 1),
        (2, 1, "b", 0),
        (3, 3, "b", 1),
    ]
    assert {s.local_world_size for s in slots} == {2}


def test_uneven_hosts_get_their_own_local_world_size():
    slots = assign_ranks({0: _engine("a", 1), 1: _engine("b", 2), 2: _engine("b", 3)})
    assert [(s.host, s.local_rank, s.local_world_size) for s in slots] == [
        ("a", 0, 1),
        ("b", 0, 2),
        ("b", 1, 2),
    ]


def test_topology_table_has_one_row_per_rank():
    records = [
        RankRecord(r, r, 2, "vm", 100 + r, "cpu", "gloo", engine_id=5 + r, address="127.0.0.1")
        for r in range(2)
    ]
    lines = format_table(records).splitlines()
    assert lines[0].split() == [
        "rank",
        "local_rank",
        "host",
        "pid",
        "device",
        "backend",
        "engine_id",
    ]
    assert lines[2].split() == ["0", "0", "vm", "100", "cpu", "gloo", "5"]
    assert lines[3].split() == ["1", "1", "vm", "101", "cpu", "gloo", "6"]


DUMP = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 4800 in barrier
  File "/x/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/ipykernel_77/123.py", line 3 in <module>
  File "/x/site-packages/IPython/core/interactiveshell.py", line 3577 in run_code
  File "/x/site-packages/ipykernel/kernelbase.py", line 500 in dispatch_shell
  File "<frozen runpy>", line 88 in _run_code
"""


def test_stack_of_the_user_thread_without_engine_machinery():
    frames = user_stack(DUMP, thread_id=0x7F0000000002)
    assert [f.function for f in frames] == ["barrier", "wrapper", "<module>"]
    assert in_distributed(frames).function == "barrier"
    assert describe(frames) == "in barrier (distributed_c10d.py:4800), called from <cell>:3"


FORKED_ENGINE_DUMP = """\
Current thread 0x00007f0000000003 (most recent call first):
  File "/tmp/ipykernel_77/124.py", line 2 in <module>
  File "/x/site-packages/IPython/core/interactiveshell.py", line 3577 in run_code
  File "/x/site-packages/ipyparallel/engine/app.py", line 1020 in launch_instance
  File "/x/site-packages/fsdp_interactive/pool/processes/_engine_entry.py", line 120 in main
  File "/x/site-packages/fsdp_interactive/pool/processes/_engine_entry.py", line 128 in <module>
  File "/usr/lib/python3.11/runpy.py", line 88 in _run_code
  File "/usr/lib/python3.11/runpy.py", line 226 in run_module
  File "/x/site-packages/fsdp_interactive/pool/processes/_forked_children.py", line 104 in _run_module
  File "/x/site-packages/fsdp_interactive/pool/processes/_forked_children.py", line 145 in <lambda>
  File "/x/site-packages/fsdp_interactive/pool/processes/_forked_children.py", line 130 in fork_child
  File "/x/site-packages/fsdp_interactive/pool/processes/_engine_forker.py", line 238 in handle
  File "/x/site-packages/fsdp_interactive/pool/processes/_engine_forker.py", line 330 in serve
  File "/x/site-packages/fsdp_interactive/pool/processes/_engine_forker.py", line 397 in main
"""
#: The same engine between cells: its event loop waits in the selector.
IDLE_FORKED_ENGINE_DUMP = """\
Current thread 0x00007f0000000003 (most recent call first):
  File "/usr/lib/python3.11/selectors.py", line 468 in select
  File "/usr/lib/python3.11/asyncio/base_events.py", line 1898 in _run_once
""" + FORKED_ENGINE_DUMP.split("\n", 3)[3]


def test_a_forked_engines_stack_hides_how_the_engine_was_started():
    frames = user_stack(FORKED_ENGINE_DUMP, thread_id=None)
    assert [f.function for f in frames] == ["<module>"]
    idle = user_stack(IDLE_FORKED_ENGINE_DUMP, thread_id=None)
    assert idle == [] and describe(idle) == "idle (no user code running)"


def test_stack_summary_quotes_the_cell_line():
    dump = (
        "Current thread 0x00000000000000aa (most recent call first):\n"
        '  File "/tmp/ipykernel_9/1.py", line 2 in <module>\n'
        '  File "/x/site-packages/IPython/core/interactiveshell.py", line 1 in run_code\n'
    )
    frames = user_stack(dump, thread_id=None)
    assert describe(frames, code="import time\ntime.sleep(30)\n") == (
        "in <module> (<cell>:2): time.sleep(30)"
    )
    assert describe(user_stack("", None)) == "idle (no user code running)"


def test_rank_error_shows_first_traceback_and_collapses_identical_ones():
    tb = "Traceback (most recent call last):\n  Cell In[{n}], line 1\nValueError: bad\n"
    err = RankError(
        {0: tb.format(n=3), 1: tb.format(n=7), 2: "ZeroDivisionError: division by zero\n"},
        {0: ("ValueError", "bad"), 1: ("ValueError", "bad"), 2: ("ZeroDivisionError", "div")},
    )
    text = str(err)
    assert err.ranks == [0, 1, 2]
    assert text.startswith("ranks 0, 1, 2 raised; ranks 0, 1:\n")
    assert text.count("ValueError: bad") == 1
    assert "rank 2: ZeroDivisionError: div" in text
    assert [ranks for ranks, _ in collapse(err.tracebacks)] == [[0, 1], [2]]


def test_rank_died_and_interrupted_messages():
    died = RankDied([1], {1: -9}, {1: "last words\n"}, hosts={1: "vm"}, pids={1: 42})
    assert "rank 1 (pid 42 on vm) died: killed by signal SIGKILL" in str(died)
    assert "last words" in str(died)
    assert describe_exit(3) == "exit code 3" and describe_exit(None) == "exit status unknown"
    interrupted = RankInterrupted([0, 1], {0: "in barrier (x.py:1)"}, [0])
    # Not "interrupted rank 0" next to "rank 0 did not stop": what was sent, what stopped.
    assert str(interrupted).startswith(
        "sent an interrupt (SIGINT) to ranks 0, 1; rank 1 stopped.\n"
        "rank 0 did not stop: in barrier (x.py:1)\n"
    )
    assert str(RankInterrupted([0], {}, [])).startswith("interrupted rank 0 (SIGINT).")
    assert interrupted.needs_restart
    assert "must be restarted" in str(interrupted) and "pool.restart()" in str(interrupted)
    assert "%fsdp restart" in interrupted.notebook_message()
    assert "pool.restart()" not in interrupted.notebook_message()
    assert isinstance(interrupted, KeyboardInterrupt)


def test_tagged_printer_tags_whole_lines_and_flushes_partials():
    out, err = io.StringIO(), io.StringIO()
    printer = TaggedPrinter(stdout=out, stderr=err)
    printer(0, "stdout", "hel")
    printer(1, "stdout", "one\ntw")
    printer(0, "stdout", "lo\n")
    printer(1, "stderr", "warn\n")
    printer.flush()
    assert out.getvalue() == "[rank 1] one\n[rank 0] hello\n[rank 1] tw\n"
    assert err.getvalue() == "[rank 1:stderr] warn\n"


def _bar(text: str, closed: bool = False) -> RankDisplay:
    state = BarState(n=1.0, total=4.0, left="", right="", text=text, closed=closed)
    return RankDisplay({"text/plain": text, MIME: state.to_wire()}, display_id="bar")


def test_tagged_printer_moves_the_lowest_ranks_line_and_prints_every_final_state():
    err = io.StringIO()
    printer = TaggedPrinter(stdout=err, stderr=err)
    printer(1, "stderr", "\rload  10%")
    printer.display(0, _bar("train  25%"))
    printer(1, "stderr", "\rload  60%")
    assert err.getvalue().endswith("\r[rank 0] train  25%")  # rank 0's moves; rank 1's waits
    assert "load  60%" not in err.getvalue()
    printer.display(0, _bar("train 100%", closed=True))
    printer(1, "stderr", "\rload 100%\nnext")
    printer.flush()
    shown = [line.text.rstrip() for line in final_lines(err.getvalue()) if line.text.strip()]
    assert shown == ["[rank 0] train 100%", "[rank 1:stderr] load 100%", "[rank 1:stderr] next"]


def test_device_count_needs_no_probe_when_hidden_or_cpu_build(monkeypatch):
    assert _count("", 5.0) == 0
    assert _count("-1", 5.0) == 0
    if not cuda_build():
        monkeypatch.setattr("subprocess.run", _forbidden)
        _count.cache_clear()
        assert _count(None, 5.0) == 0


def _forbidden(*args, **kwargs):
    pytest.fail("a subprocess probe was started for a CPU-only torch build")
