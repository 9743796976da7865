"""Pure parts of the diagnostics: recorder diagnosis and table, stack text, advice, reports."""

from __future__ import annotations

import dataclasses

from fsdp_interactive.pool.common._collectives import (
    CollectiveRecord,
    CollectiveTrace,
    RecorderDump,
    diagnose,
    format_sizes,
    table_rows,
)
from fsdp_interactive.pool.common._stacks import Frame, describe, format_stack, with_cell_sources
from fsdp_interactive.pool.diagnostics._interrupt import InterruptReport
from fsdp_interactive.pool.errors import PoolBusy, RankError, RankTimeout


def _record(seq: int, op: str, *, size=(4,), completed=True, group="0", line=3) -> CollectiveRecord:
    return CollectiveRecord(
        group=group,
        group_desc="default_pg" if group == "0" else "sub",
        seq=seq,
        op=op,
        backend="gloo",
        input_sizes=(tuple(size),),
        output_sizes=(tuple(size),),
        input_dtypes=("Float",),
        output_dtypes=("Float",),
        completed=completed,
        issued_at=Frame("/tmp/ipykernel_1/2.py", line, "<module>", "x", "Cell In[9]"),
    )


def _dump(*records: CollectiveRecord) -> RecorderDump:
    return RecorderDump(records=records, last_issued={"0": max(r.seq for r in records)})


def test_one_sided_collective_names_the_waiting_and_the_missing_rank():
    dumps = {
        0: _dump(_record(11, "all_reduce"), _record(12, "barrier", size=(), completed=False)),
        1: _dump(_record(11, "all_reduce")),
    }
    assert diagnose(dumps, finished=[1]) == [
        "rank 0 waits in barrier #12; rank 1 never issued #12 (it finished the cell after #11)"
    ]
    where = {1: "in <module> (Cell In[9], line 5): time.sleep(120)"}
    assert diagnose(dumps, where=where) == [
        "rank 0 waits in barrier #12; rank 1 never issued #12 (it last issued #11 and is now "
        "in <module> (Cell In[9], line 5): time.sleep(120))"
    ]


def test_different_collectives_under_one_number_are_named_side_by_side():
    dumps = {
        0: _dump(_record(57, "all_gather", completed=False)),
        1: _dump(_record(57, "reduce_scatter", completed=False)),
        2: _dump(_record(57, "all_gather", completed=False)),
    }
    assert diagnose(dumps)[0] == "ranks 0, 2 all_gather #57 vs rank 1 reduce_scatter #57"
    shapes = {
        0: _dump(_record(7, "all_reduce", size=(64,))),
        1: _dump(_record(7, "all_reduce", size=(32,))),
    }
    assert diagnose(shapes) == [
        "rank 0 all_reduce #7 (Float 64) vs rank 1 all_reduce #7 (Float 32)"
    ]


def test_agreeing_ranks_give_no_finding_and_an_unavailable_recorder_a_note():
    agree = {r: _dump(_record(3, "all_reduce"), _record(4, "barrier", size=())) for r in (0, 1)}
    assert diagnose(agree) == []
    off = {
        0: RecorderDump(note="torch 2.9 does not record gloo collectives"),
        1: RecorderDump(note="torch 2.9 does not record gloo collectives"),
    }
    assert diagnose(off) == [
        "collective trace unavailable on ranks 0, 1: torch 2.9 does not record gloo collectives"
    ]


def test_subgroups_are_diagnosed_on_their_own():
    dumps = {
        0: _dump(_record(5, "all_reduce"), _record(2, "all_reduce", group="1", completed=False)),
        1: _dump(_record(5, "all_reduce"), _record(1, "all_reduce", group="1")),
    }
    assert diagnose(dumps, finished=[1]) == [
        "group 1 (sub): rank 0 waits in all_reduce #2; rank 1 never issued #2 "
        "(it finished the cell after #1)"
    ]


def test_table_merges_agreeing_ranks_and_marks_what_was_not_issued():
    dumps = {
        0: _dump(_record(11, "all_reduce"), _record(12, "barrier", size=(), completed=False)),
        1: _dump(_record(11, "all_reduce")),
    }
    rows = table_rows(dumps)
    assert rows[0][:4] == ("0", "11", "all", "all_reduce") and rows[0][-2:] == (
        "done",
        "Cell In[9], line 3",
    )
    assert rows[1][:4] == ("0", "12", "0", "barrier") and rows[1][-2] == "waiting"
    assert rows[2][:4] == ("0", "12", "1", "(not issued)")
    text = str(CollectiveTrace(dumps, diagnose(dumps)))
    assert text.splitlines()[0].startswith("rank 0 waits in barrier #12")
    assert "(not issued)" in text
    assert format_sizes([[3, 4], [2], []]) == "3x4, 2, scalar" and format_sizes([]) == "-"


def test_stacks_read_like_tracebacks_with_cell_numbers_and_sources():
    frames = [
        Frame("/x/torch/distributed/distributed_c10d.py", 5356, "barrier", "work.wait()"),
        Frame("/tmp/ipykernel_5/77.py", 3, "<module>", "dist.barrier()", "Cell In[15]"),
    ]
    assert format_stack(frames) == (
        "  Cell In[15], line 3, in <module>\n"
        "    dist.barrier()\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 5356, in barrier\n'
        "    work.wait()"
    )
    assert describe(frames) == (
        "in barrier (distributed_c10d.py:5356), called from Cell In[15], line 3: dist.barrier()"
    )
    bare = [Frame("/tmp/ipykernel_5/77.py", 2, "<module>")]
    completed = with_cell_sources(bare, "import time\ntime.sleep(120)\n", "Cell In[4]")
    assert format_stack(completed) == "  Cell In[4], line 2, in <module>\n    time.sleep(120)"


def test_errors_name_api_calls_for_callers_and_magics_for_notebooks():
    busy = PoolBusy([0])
    assert str(busy).startswith("rank 0 still runs an earlier call")
    assert "pool.interrupt()" in str(busy) and "%fsdp interrupt" in busy.notebook_message()
    assert "err.wait()" in str(busy) and ".wait()" not in busy.notebook_message()
    blocked = PoolBusy([0, 1], blocked=[0])
    assert str(blocked).startswith("ranks 0, 1 still run")
    assert "rank 0 is blocked inside a collective" in str(blocked)
    assert (
        "%fsdp restart" in blocked.notebook_message()
        and "%fsdp interrupt" not in blocked.notebook_message()
    )
    timeout = RankTimeout("head", "tail", {}, {}, [0], lambda t: None)
    assert "Keep waiting with hang.wait()" in timeout.notebook_message(out="hang")
    assert "%fsdp trace" in timeout.notebook_message() and "pool.trace()" in str(timeout)
    error = RankError({1: "Traceback\nValueError: x\n"}, {1: ("ValueError", "x")})
    assert "%fsdp debug -r 1" in error.notebook_message() and "pool.debug(1" in str(error)


def test_interrupt_report_says_per_rank_what_happened():
    report = InterruptReport(
        signalled=[0, 1, 2],
        stopped=[1],
        blocked={0: "in barrier (distributed_c10d.py:5356)"},
        idle=[2],
    )
    lines = report.lines(notebook=True)
    assert lines[:3] == [
        "rank 0: did not stop: blocked in a collective, in barrier (distributed_c10d.py:5356)",
        "rank 1: stopped",
        "rank 2: was idle (nothing to stop)",
    ]
    assert "%fsdp restart" in lines[3] and report.needs_restart
    assert "pool.restart()" in str(report) and "pool.recover()" in str(report)
    # Without a snapshot to go back to, only the restart is named.
    alone = dataclasses.replace(report, snapshot_taken=False).lines(notebook=True)[3]
    assert "%fsdp restart" in alone and "%fsdp recover" not in alone


def test_rooted_collectives_with_per_rank_sizes_are_not_a_mismatch():
    root = CollectiveRecord(
        "0", "default_pg", 9, "gather", "gloo", ((7,),), ((2, 7),), ("Byte",), ("Byte",)
    )
    leaf = CollectiveRecord("0", "default_pg", 9, "gather", "gloo", ((7,),), (), ("Byte",), ())
    assert diagnose({0: _dump(root), 1: _dump(leaf)}) == []
