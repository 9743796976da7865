"""%fsdp / %%fsdp / %fsdp_auto through a real IPython shell against a real 2-rank pool."""

from __future__ import annotations

import io
import re
import sys
import threading
import time

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from fsdp_interactive.notebook.magics import FsdpMagics, parse_targets
from fsdp_interactive.pool import RankError, RankInterrupted, RankTimeout, RunResult
from tests.notebook.debugger_transcript import debugger_answers


def cell(shell, line, body):
    return shell.run_cell_magic("fsdp", line, body)


def test_default_shows_rank0_output_and_every_ranks_errors(pool_shell, pool, capsys):
    cell(
        pool_shell,
        "--no-stream",
        "import sys\nprint('hi from', rank)\nprint('warn', rank, file=sys.stderr)",
    )
    out, err = capsys.readouterr()
    assert "hi from 0" in out and "hi from 1" not in out
    assert "[rank 0:stderr] warn 0" in err and "[rank 1:stderr] warn 1" in err
    assert "rank 1 printed other output" in out


@pytest.mark.timing
def test_streamed_output_is_shown_while_running(pool_shell, pool, capsys):
    cell(
        pool_shell,
        "--stream",
        "import sys\nprint('streamed', rank)\nprint('e', rank, file=sys.stderr)",
    )
    out, err = capsys.readouterr()
    assert out.count("streamed 0") == 1 and "streamed 1" not in out
    assert "[rank 0:stderr] e 0" in err and "[rank 1:stderr] e 1" in err


@pytest.mark.parametrize("grouping", ["", "--group-outputs rank"])
def test_streamed_identical_stderr_lines_are_shown_once_with_their_ranks(
    pool_shell, pool, capsys, grouping
):
    body = (
        "import sys, warnings\n"
        "warnings.warn_explicit('the same advice on every rank', UserWarning, 'library.py', 7)\n"
        "print('then this', file=sys.stderr)\n"
        "if rank == 1:\n"
        "    print('only rank 1 says this', file=sys.stderr)\n"
    )
    cell(pool_shell, f"--stream {grouping}", body)
    _, err = capsys.readouterr()
    warning = "[ranks 0,1:stderr] library.py:7: UserWarning: the same advice on every rank\n"
    assert err.count("the same advice on every rank") == 1 and warning in err
    assert err.count("then this") == 1 and "[ranks 0,1:stderr] then this" in err
    assert err.index(warning) < err.index("then this")
    assert "[rank 1:stderr] only rank 1 says this" in err


def test_identical_outputs_are_grouped(pool_shell, pool, capsys):
    cell(pool_shell, "--no-stream", "import sys\nprint('same', file=sys.stderr)")
    _, err = capsys.readouterr()
    assert err.count("[ranks 0,1:stderr] same") == 1
    cell(pool_shell, "--no-stream --group-outputs rank", "print('same')")
    out, _ = capsys.readouterr()
    assert out.count("[ranks 0,1] same") == 1


def test_group_outputs_type_and_order(pool_shell, pool, capsys):
    code = "import sys\nprint('out', rank)\nprint('err', rank, file=sys.stderr)"
    cell(pool_shell, "--no-stream --group-outputs type", code)
    out, err = capsys.readouterr()
    assert out.index("[rank 0] out 0") < out.index("[rank 1] out 1")
    assert "[rank 0:stderr] err 0" in err and "[rank 1:stderr] err 1" in err
    with capture_output() as captured:
        cell(
            pool_shell,
            "--no-stream --group-outputs order",
            "from IPython.display import HTML, display\n"
            "display(HTML(f'<i>first {rank}</i>'))\ndisplay(HTML('<i>second</i>'))",
        )
    html = [o.data.get("text/html") for o in captured.outputs]
    assert html == ["<i>first 0</i>", "<i>first 1</i>", "<i>second</i>"]
    assert "[ranks 0,1: output 1]" in captured.stdout


def test_rich_output_and_last_value_from_rank0_are_shown(pool_shell, pool):
    with capture_output() as captured:
        cell(
            pool_shell,
            "--no-stream",
            "from IPython.display import HTML, display\ndisplay(HTML('<b>bold</b>'))\nrank + 40",
        )
    data = [o.data for o in captured.outputs]
    assert data[0]["text/html"] == "<b>bold</b>"
    assert data[1]["text/plain"] == "40"


def test_failing_rank_fails_the_cell(pool_shell, pool, capsys):
    result = pool_shell.run_cell(
        "%%fsdp --no-stream\nprint('before', rank)\nif rank == 1:\n    raise ValueError('bad rank')"
    )
    assert "before 0" in capsys.readouterr().out  # what ran before the failure is shown
    assert not result.success
    error = result.error_in_exec
    assert isinstance(error, RankError) and error.ranks == [1]
    assert "bad rank" in str(error)
    assert "ValueError: bad rank" in "\n".join(error._render_traceback_())


def test_a_name_defined_in_the_kernel_only_says_to_push_it(pool_shell, pool):
    pool_shell.run_cell("kernel_only_lr = 0.25")
    result = pool_shell.run_cell("%%fsdp --no-stream\nscaled = kernel_only_lr * 4")
    assert not result.success
    message = "\n".join(result.error_in_exec._render_traceback_())  # what the cell shows
    assert "NameError: name 'kernel_only_lr' is not defined" in message
    assert "Send the kernel's kernel_only_lr to the ranks with %fsdp push kernel_only_lr" in message
    assert "pool.push" not in message
    pool_shell.run_line_magic("fsdp", "push kernel_only_lr")
    cell(pool_shell, "--no-stream", "scaled = kernel_only_lr * 4")
    assert pool.pull("scaled") == [1.0, 1.0]


@pytest.mark.timing
def test_timeout_shows_every_ranks_stack(pool_shell, pool, tmp_path):
    go = tmp_path / "go"  # rank 1 is slow until the report is out
    body = (
        f"import os, time\nif rank == 1:\n    while not os.path.exists({str(go)!r}):\n"
        "        time.sleep(0.05)\ndist.barrier()\n"
    )
    try:
        with pytest.raises(RankTimeout) as info:
            cell(pool_shell, "--timeout 1 -o timed_out --no-stream", body)
    finally:
        go.touch()
    error = info.value
    assert set(error.stacks) == {0, 1}
    assert "sleep" in error.where[1], error.where
    assert "barrier" in error.stacks[0]
    assert pool_shell.user_ns["timed_out"] is error
    error.wait(60)  # let the run finish so that the group is clean again


def test_targets_run_on_chosen_ranks_only(pool_shell, pool, capsys):
    cell(pool_shell, "--no-stream", "targeted = -1")
    cell(pool_shell, "--targets 1 --no-stream", "targeted = rank\nprint('ran on', rank)")
    out, _ = capsys.readouterr()
    assert "ran on 1" in out
    assert pool.pull("targeted") == [-1, 1]


def test_bad_targets_and_options_say_what_to_type(pool_shell, pool):
    with pytest.raises(UsageError, match=r"--targets 0-1 or --targets all"):
        cell(pool_shell, "--targets 5", "pass")
    with pytest.raises(UsageError, match=r"--targets 0, --targets 0,1"):
        cell(pool_shell, "--targets x", "pass")
    with pytest.raises(UsageError, match=r"usage: %%fsdp \[--targets"):
        cell(pool_shell, "--bogus", "pass")
    with pytest.raises(UsageError, match=r"unknown %fsdp command 'launch'.*%fsdp start"):
        pool_shell.run_line_magic("fsdp", "launch")
    with pytest.raises(UsageError, match=r"already running.*%fsdp restart"):
        pool_shell.run_line_magic("fsdp", "start")
    with pytest.raises(UsageError, match="takes no arguments"):
        pool_shell.run_line_magic("fsdp", "status now")
    with pytest.raises(UsageError, match="%fsdp_auto on or %fsdp_auto off"):
        pool_shell.run_line_magic("fsdp_auto", "maybe")


def test_parse_targets():
    assert parse_targets("all", 4) is None
    assert parse_targets("0,2", 4) == [0, 2]
    assert parse_targets("1-3", 4) == [1, 2, 3]


def test_no_pool_is_a_usage_error(shell):
    magics = FsdpMagics(shell)
    with pytest.raises(UsageError, match=r"no running pool.*%fsdp start -n 2"):
        magics.fsdp_cell("", "x = 1")
    with pytest.raises(UsageError, match="no running pool"):
        magics.fsdp("push x")


def test_local_also_runs_in_the_kernel_and_out_keeps_the_result(pool_shell, pool):
    pool_shell.user_ns.pop("both", None)
    cell(pool_shell, "--local --no-stream -o run", "both = 7\nprint('x')")
    assert pool_shell.user_ns["both"] == 7
    assert pool.pull("both") == [7, 7]
    run = pool_shell.user_ns["run"]
    assert isinstance(run, RunResult) and run.ranks == [0, 1]


def test_push_and_pull(pool_shell, pool):
    pool_shell.user_ns.update(lr=0.5, names=["a", "b"])
    pool_shell.run_line_magic("fsdp", "push lr names")
    assert pool.pull("lr") == [0.5, 0.5] and pool.pull("names") == [["a", "b"]] * 2
    with pytest.raises(UsageError, match="no variable 'missing' in the notebook"):
        pool_shell.run_line_magic("fsdp", "push missing")
    cell(pool_shell, "--no-stream", "scaled = lr * (rank + 1)")
    pool_shell.run_line_magic("fsdp", "pull scaled --rank 1")
    assert pool_shell.user_ns["scaled"] == 1.0
    with pytest.raises(UsageError, match=r"no variable|not defined"):
        pool_shell.run_line_magic("fsdp", "pull not_there")
    with pytest.raises(UsageError, match="--rank 3 does not exist"):
        pool_shell.run_line_magic("fsdp", "pull scaled --rank 3")


def test_pull_gathers_a_dtensor_parameter_as_a_plain_cpu_tensor(pool_shell, pool):
    cell(
        pool_shell,
        "--no-stream",
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "torch.manual_seed(0)\n"
        "pulled_model = torch.nn.Linear(5, 3)\n"
        "fully_shard(pulled_model, mesh=init_device_mesh('cpu', (world_size,)))\n"
        "big = torch.zeros(300, 300)\n",
    )
    pool_shell.run_line_magic("fsdp", "pull pulled_model.weight --as w")
    w = pool_shell.user_ns["w"]
    torch.manual_seed(0)
    expected = torch.nn.Linear(5, 3).weight.detach()
    assert type(w) is torch.Tensor and w.device.type == "cpu"
    assert torch.equal(w, expected)
    with pytest.raises(UsageError, match=r"too large.*--force"):
        pool_shell.run_line_magic("fsdp", "pull big --max-bytes 1000")
    with pytest.raises(UsageError, match=r"is a module.*state_dict"):
        pool_shell.run_line_magic("fsdp", "pull pulled_model")
    pool_shell.run_line_magic("fsdp", "pull pulled_model.state_dict() --as pulled_state")
    assert torch.equal(pool_shell.user_ns["pulled_state"]["weight"], expected)
    pool_shell.run_line_magic("fsdp", "pull big --max-bytes 1000 --force")
    assert pool_shell.user_ns["big"].shape == (300, 300)


def test_auto_mode_runs_cells_on_the_ranks(pool_shell, pool):
    pool_shell.user_ns.pop("auto_value", None)
    pool_shell.run_line_magic("fsdp_auto", "on")
    try:
        assert pool_shell.run_cell("auto_value = rank + 10").success
        assert pool_shell.run_cell("# local\nlocal_value = 3").success
        assert pool_shell.run_cell("%fsdp status").success
    finally:
        pool_shell.run_line_magic("fsdp_auto", "off")
    assert "auto_value" not in pool_shell.user_ns
    assert pool.pull("auto_value") == [10, 11]
    assert pool_shell.user_ns["local_value"] == 3
    pool_shell.run_cell("after_auto = 1")
    assert pool_shell.user_ns["after_auto"] == 1


def test_status_shows_topology_and_memory(pool_shell, pool, capsys):
    pool_shell.run_line_magic("fsdp", "status")
    out, _ = capsys.readouterr()
    assert "pool running, 2 ranks" in out
    for record in pool.topology:
        assert str(record.pid) in out
    assert "RSS" in out and "MiB" in out


@pytest.mark.timing
def test_interrupt_stops_a_running_cell(pool_shell, pool, tmp_path):
    # %fsdp interrupt is typed (from another thread) once both ranks run the loop.
    arrived = [tmp_path / f"arrived{rank}" for rank in (0, 1)]
    typed = threading.Event()

    def interrupt_once_arrived() -> None:
        end = time.monotonic() + 120
        while not all(path.exists() for path in arrived) and time.monotonic() < end:
            time.sleep(0.02)
        pool_shell.run_line_magic("fsdp", "interrupt")
        typed.set()

    threading.Thread(target=interrupt_once_arrived, daemon=True).start()
    result = pool_shell.run_cell(
        # the marker is written inside the loop: once it exists, ``step`` does too
        "%%fsdp --no-stream\nimport os, time\nfor step in range(1200):\n    if step == 0:\n"
        f"        open(os.path.join({str(tmp_path)!r}, f'arrived{{rank}}'), 'w').close()\n"
        "    time.sleep(0.05)"
    )
    assert typed.wait(60), "%fsdp interrupt was never typed"
    assert not result.success
    error = result.error_in_exec
    assert isinstance(error, RankInterrupted), error
    assert error.ranks == [0, 1] and not error.needs_restart
    assert pool.pull("step")[0] < 1199  # stopped by the interrupt, not by its end


def test_restart_gives_a_fresh_group(pool_shell, pool):
    cell(pool_shell, "--no-stream", "before_restart = 1")
    pool_shell.run_line_magic("fsdp", "restart")
    result = pool_shell.run_cell("%%fsdp --no-stream\nbefore_restart")
    assert isinstance(result.error_in_exec, RankError)
    assert {name for name, _ in result.error_in_exec.errors.values()} == {"NameError"}


def test_timeout_names_magics_and_interrupt_says_what_it_did(pool_shell, pool, capsys):
    body = "import time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(120)\n"
    result = pool_shell.run_cell(f"%%fsdp --timeout 3 -o stuck --no-stream\n{body}")
    error = result.error_in_exec
    assert isinstance(error, RankTimeout)
    shown = "\n".join(error._render_traceback_())
    assert "Keep waiting with stuck.wait()" in shown and "%fsdp interrupt" in shown
    assert "pool.interrupt()" not in shown and "err.wait()" not in shown
    assert "collectives: rank 0 waits in barrier #" in shown
    assert "time.sleep(120)" in error.stacks[1]
    capsys.readouterr()
    pool_shell.run_line_magic("fsdp", "interrupt")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rank 0: did not stop: blocked in a collective, in barrier")
    assert out[1] == "rank 1: stopped"
    # A recovery is named only when there is a snapshot to go back to.
    recover = "%fsdp recover (back to the last snapshot) or " if pool.snapshots() else ""
    assert f"only a new group frees it: {recover}%fsdp restart" in out[2]
    busy = pool_shell.run_cell("%%fsdp\n1")
    assert "%fsdp restart" in "\n".join(busy.error_in_exec._render_traceback_())
    pool_shell.run_line_magic("fsdp", "restart")
    assert "restarted: rank state discarded (2 fresh ranks" in capsys.readouterr().out


def test_state_changing_magics_print_one_line_of_result(pool_shell, pool, capsys):
    pool_shell.user_ns["factor"] = 3
    pool_shell.run_line_magic("fsdp", "push factor")
    assert capsys.readouterr().out == "pushed factor to 2 ranks\n"
    cell(pool_shell, "--no-stream", "head_w = torch.zeros(64, 32)\nsizes = {'a': 1, 'b': 2}")
    capsys.readouterr()
    pool_shell.run_line_magic("fsdp", "pull head_w")
    pool_shell.run_line_magic("fsdp", "pull sizes --as pulled_sizes")
    assert capsys.readouterr().out == (
        "head_w <- Tensor (64, 32) float32\npulled_sizes <- dict (2 items)\n"
    )


def test_cells_are_numbered_as_the_shell_numbers_them(pool_shell, pool):
    result = pool_shell.run_cell("%%fsdp --no-stream\nvalue = 1\nraise KeyError('missing')")
    number = result.execution_count
    assert isinstance(number, int)
    error = result.error_in_exec
    assert f"Cell In[{number}], line 2" in error.tracebacks[0]
    assert "Look at the failing frame with %fsdp debug -r 0." in "\n".join(
        error._render_traceback_()
    )


@pytest.mark.timing
def test_debug_magic_runs_one_command_or_a_session_on_the_last_failure(
    pool_shell, pool, capsys, monkeypatch
):
    pool_shell.run_cell(
        "%%fsdp --no-stream\nlocal_value = 7 * (rank + 1)\nif rank == 1:\n    1 / 0\n"
    )
    capsys.readouterr()
    pool_shell.run_line_magic("fsdp", "debug -r 1 p local_value")
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "14"
    assert "ZeroDivisionError: division by zero" in out
    # without a command: a prompt, fed from stdin, until q
    monkeypatch.setattr(sys, "stdin", io.StringIO("p local_value + 1\nwhere\nq\n"))
    pool_shell.run_line_magic("fsdp", "debug")  # the last failing rank (1)
    out = capsys.readouterr().out
    assert "(rank 1 Pdb) 15\n" in out and "session ended" in out
    with pytest.raises(UsageError, match="type a rank number"):
        pool_shell.run_line_magic("fsdp", "debug -r one p x")
    with pytest.raises(UsageError, match=r"no such rank.*0\.\.1"):
        pool_shell.run_line_magic("fsdp", "debug -r 4 p x")


@pytest.mark.timing
def test_breakpoint_asks_for_commands_through_input(pool_shell, pool, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("p count\nn\np count\nc\n"))
    cell(
        pool_shell,
        "--group-outputs rank",
        "import fsdp_interactive\ncount = rank * 5\nfsdp_interactive.breakpoint(rank=1)\n"
        "count += 1\nprint('count', count)\n",
    )
    out = capsys.readouterr().out
    assert "rank 1 stopped; the other ranks wait" in out
    assert "-> count += 1\n" in out
    # Stepping lets rank 0 run on: its lines may come between rank 1's prompts.
    assert debugger_answers(out.split("rank 1 stopped; the other ranks wait", 1)[1], 1)[:2] == [
        "5",
        "6",
    ]
    assert "[rank 0] count 1" in out and "[rank 1] count 6" in out


def test_trace_shows_a_table_or_a_timeline(pool_shell, pool, capsys):
    cell(pool_shell, "--no-stream", "for _ in range(3):\n    dist.all_reduce(torch.ones(2, 3))")
    capsys.readouterr()
    pool_shell.run_line_magic("fsdp", "trace --last 3")
    out = capsys.readouterr().out
    assert out.startswith("the ranks agree on every recorded collective\n")
    assert len(re.findall(r"all +all_reduce +2x3 +2x3 +Float +done", out)) == 3
    with capture_output() as captured:
        pool_shell.run_line_magic("fsdp", "trace --plot")
    assert [o for o in captured.outputs if "image/png" in o.data]
    with pytest.raises(UsageError, match="--last 0"):
        pool_shell.run_line_magic("fsdp", "trace --last 0")
