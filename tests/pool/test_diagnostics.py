"""Diagnostics on real ranks: the agents' stacks, the signal fallback, the flight recorder,
cell numbers, the post-mortem debugger, breakpoints, interrupts, titles, strict checks."""

from __future__ import annotations

import builtins
import io
import os
import sys
import time

import psutil
import pytest

from fsdp_interactive.pool import Pool, PoolError, RankError, RankTimeout
from tests.pool.conftest import record

# The model is bound in a call before the snapshot's: the one a recovery replays.
BUILD = "import torch, fsdp_interactive\ntiny = torch.nn.Linear(2, 2)\n"
SNAPSHOT = "fsdp_interactive.snapshot(model=tiny)\n"
ONE_SIDED = "import time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(120)\n"


@pytest.mark.timing
def test_a_hang_names_each_ranks_last_collective_and_the_mismatch(pool: Pool, capsys):
    began = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(ONE_SIDED, timeout=3, stream=False, cell=12)
    report_s = time.monotonic() - began - 3
    err = info.value
    [finding] = err.diagnosis
    seq = int(finding.split("#")[1].split(";")[0])
    assert finding == (
        f"rank 0 waits in barrier #{seq}; rank 1 never issued #{seq} (it last issued "
        f"#{seq - 1} and is now in <module> (Cell In[12], line 5): time.sleep(120))"
    )
    assert "time.sleep(120)" in err.stacks[1]
    assert "  Cell In[12], line 3, in <module>\n    dist.barrier()" in err.stacks[0]
    assert "from the stack signal" not in err.stacks[0]  # the blocked rank's agent answered
    records = {r.seq: r for r in err.collectives[0].records}
    assert records[seq].op == "barrier" and records[seq].completed is False
    assert seq not in {r.seq for r in err.collectives[1].records}
    text = str(err)
    assert "--- last collectives of every rank (flight recorder) ---" in text
    assert "(not issued)" in text
    trace = pool.trace(last=5)
    assert trace.findings == [
        f"rank 0 waits in barrier #{seq}; rank 1 never issued #{seq} (it last issued #{seq - 1})"
    ]
    with capsys.disabled():
        print(f"\n[measured] timeout report (stacks + recorder of 2 ranks): {report_s:.2f}s")
    pool.restart()
    record(pool)


@pytest.mark.timing
def test_a_rank_holding_the_gil_answers_through_the_stack_signal(pool: Pool):
    code = "import re\nre.match(r'(a+)+$', 'a' * 36 + 'b')\n"
    with pytest.raises(RankTimeout) as info:
        pool.run(code, timeout=2, stream=False, cell=4)
    err = info.value
    for rank in (0, 1):
        assert "(from the stack signal: the rank's agent did not answer" in err.stacks[rank]
        assert "  Cell In[4], line 2, in <module>\n    re.match(" in err.stacks[rank]
    assert err.where[0].startswith("in match (__init__.py:")
    pool.restart()
    record(pool)


def test_recorder_rows_name_op_shape_dtype_and_the_issuing_line(pool: Pool):
    pool.run(
        "t = torch.ones(3, 4, dtype=torch.float64)\ndist.all_reduce(t)\n"
        "dist.broadcast(torch.zeros(5, dtype=torch.int64), 0)\n",
        stream=False,
        cell=8,
    )
    trace = pool.trace(last=2, issued_at=True)
    assert trace.findings == []
    rows = [line.split() for line in trace.table().splitlines()]
    assert rows[0] == ["group", "#", "ranks", "op", "in", "out", "dtype", "state", "issued", "at"]
    assert rows[1][2:8] == ["all", "all_reduce", "3x4", "3x4", "Double", "done"]
    assert " ".join(rows[1][8:]) == "Cell In[8], line 2"
    assert rows[2][2:8] == ["all", "broadcast", "5", "5", "Long", "done"]


def test_tracebacks_carry_the_notebook_cell_number_and_debug_reads_the_failing_frame(pool: Pool):
    pool.restart()  # rank 0 keeps no failure from an earlier test's cell
    code = "answer = 40 + rank\nif rank == 1:\n    raise ValueError('only rank 1')\n"
    with pytest.raises(RankError) as info:
        pool.run(code, stream=False, cell=27)
    assert "Cell In[27], line 3" in info.value.tracebacks[1]
    intro = pool.debug(1)
    assert "ValueError: only rank 1" in intro and "> Cell In[27](3)<module>()" in intro
    assert pool.debug(1, "p answer").strip() == "41"
    assert pool.debug(1, "p answer + 1").strip() == "42"
    ended = pool.debug(1, "q")
    assert not ended.active and "session ended" in ended
    with pytest.raises(PoolError, match="rank 0 has no failure to debug"):
        pool.debug(0, "p answer")
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        pool.debug(5)


def test_a_numbered_cell_keeps_its_lines_and_code_without_a_number_keeps_no_failure(pool: Pool):
    # IPython's own cleanup sees the cell as the notebook has it: the leading blank line
    # goes and the common indentation is removed, exactly as for a notebook cell.
    code = "\n    kept = 70 + rank\n    kept / 0\n"
    with pytest.raises(RankError) as info:
        pool.run(code, stream=False, cell=31)
    assert "Cell In[31], line 2" in info.value.tracebacks[0]
    assert pool.run("kept", stream=False, cell=32).results == {0: "70", 1: "71"}
    with pytest.raises(RankError) as plain:
        pool.run("dropped = 1\nraise KeyError('not a notebook cell')\n", stream=False)
    assert "Cell In[31]" not in plain.value.tracebacks[0]
    assert "line 2" in plain.value.tracebacks[0]
    intro = pool.debug(0)
    assert "ZeroDivisionError" in intro and "> Cell In[31](2)<module>()" in intro
    assert pool.debug(0, "p kept").strip() == "70"
    assert not pool.debug(0, "q").active


@pytest.mark.timing
def test_a_breakpoint_on_one_rank_takes_commands_and_the_others_wait(pool: Pool, monkeypatch):
    typed = io.StringIO("p step\nn\np step\nc\n")
    prompts: list[str] = []

    def fake_input(prompt: str) -> str:
        prompts.append(prompt)
        line = typed.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    monkeypatch.setattr(builtins, "input", fake_input)
    code = (
        "import fsdp_interactive\n"
        "step = rank * 10\n"
        "fsdp_interactive.breakpoint(rank=1)\n"
        "step += 1\n"
        "print('after', step)\n"
    )
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    result = pool.run(code, stream=False, cell=3)
    monkeypatch.undo()
    assert prompts == ["(rank 1 Pdb) "] * 4
    transcript = out.getvalue()
    assert "rank 1 stopped; the other ranks wait" in transcript
    assert "> Cell In[3](4)<module>()\n-> step += 1\n10\n" in transcript
    assert "> Cell In[3](5)<module>()\n-> print('after', step)\n11\n" in transcript
    assert result.stdout == {0: "after 1\n", 1: "after 11\n"}


def test_breakpoint_commands_run_unattended_and_bad_ranks_are_refused(pool: Pool):
    code = (
        "import fsdp_interactive\nx = rank + 100\n"
        "fsdp_interactive.breakpoint(rank=0, commands=['p x', 'p x * 2'])\nprint('done', x)\n"
    )
    result = pool.run(code, stream=False, cell=5)
    assert result.stdout == {0: "done 100\n", 1: "done 101\n"}
    assert "(rank 0 Pdb) p x\n100\n(rank 0 Pdb) p x * 2\n200\n" in result.stderr[0]
    with pytest.raises(RankError) as info:
        pool.run("import fsdp_interactive\nfsdp_interactive.breakpoint(rank=7)\n", stream=False)
    assert "rank must be a rank of the pool (0..1), got 7" in str(info.value)


@pytest.mark.timing
def test_interrupt_says_a_rank_blocked_in_a_collective_needs_a_restart(pool: Pool):
    # With a snapshot taken, the advice names the recovery too (without one, only a restart:
    # tests/notebook/test_debugging_shell.py).
    pool.run(BUILD, stream=False)
    pool.run(SNAPSHOT, stream=False)
    with pytest.raises(RankTimeout):
        pool.run(ONE_SIDED, timeout=2, stream=False)
    report = pool.interrupt()
    assert report.stopped == [1]
    assert list(report.blocked) == [0] and "in barrier" in report.blocked[0]
    assert pool.needs_restart
    lines = report.lines()
    assert lines[:2] == [
        f"rank 0: did not stop: blocked in a collective, {report.blocked[0]}",
        "rank 1: stopped",
    ]
    assert (
        "only a new group frees it: pool.recover() (back to the last snapshot) or pool.restart()"
        in lines[2]
    )
    pool.restart()
    record(pool)
    assert pool.interrupt().idle == [0, 1]


def test_native_stacks_show_the_cpp_frames_of_a_blocked_rank(pool: Pool):
    with pytest.raises(RankTimeout):
        pool.run(ONE_SIDED, timeout=2, stream=False)
    stacks, _ = pool.stacks(native=True)
    native = stacks[0].split("--- native stack (py-spy) ---\n", 1)[1]
    assert "gloo" in native.lower() or "c10d" in native
    pool.restart()
    record(pool)


def test_ranks_carry_a_process_title_that_ps_shows(pool: Pool):
    for rank_record in pool.topology:
        cmdline = " ".join(psutil.Process(rank_record.pid).cmdline())
        # whose pool it is, and no random name of a private file (every user reads it)
        title = f"fsdp-interactive rank {rank_record.rank}/2, kernel pid {os.getpid()}"
        assert cmdline.strip() == title
        # the environment stays readable (setproctitle is told to leave it alone)
        assert psutil.Process(rank_record.pid).environ()


def test_bad_debugging_options_are_refused(pool: Pool):
    with pytest.raises(ValueError, match="last must be a number of collectives"):
        pool.trace(last=0)
    with pytest.raises(ValueError, match="cell must be the notebook's execution count"):
        pool.run("1", cell="3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flight_recorder must be a number of entries"):
        Pool(flight_recorder=-1)
    with pytest.raises(ValueError, match="check_collectives must be True or False"):
        Pool(check_collectives="yes")  # type: ignore[arg-type]


def test_strict_collectives_turn_a_shape_mismatch_into_an_error_and_no_recorder_is_said(
    profile_dir: str,
):
    strict = Pool(
        n=2,
        devices="cpu",
        profile_dir=profile_dir,
        show_topology=False,
        check_collectives=True,
        flight_recorder=0,
    )
    try:
        strict.start()
        record(strict)
        with pytest.raises(RankError) as info:
            strict.run(
                "dist.all_reduce(torch.ones(4 if rank == 0 else 6))", stream=False, timeout=120
            )
        text = str(info.value)
        assert "Detected mismatch between collectives" in text
        assert (
            "OpType=ALLREDUCE" in text and "TensorShape=[4]" in text and "TensorShape=[6]" in text
        )
    finally:
        record(strict)
        strict.stop()
