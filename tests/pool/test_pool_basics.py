"""run / call / push / pull, output tagging, errors, topology and isolation on 2 real ranks."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool import Pool, RankError, RunResult


def test_run_executes_on_every_rank_in_a_persistent_namespace(pool: Pool):
    pool.run("counter = rank * 10", stream=False)
    result = pool.run("counter += 1\ncounter", stream=False)
    assert isinstance(result, RunResult)
    assert result.ranks == [0, 1]
    assert result.results == {0: "1", 1: "11"}


def test_run_collects_result_bundles_and_displays(pool: Pool):
    code = (
        "from IPython.display import display, HTML\n"
        "display(HTML(f'<b>rank {rank}</b>'))\n"
        "{'rank': rank}"
    )
    result = pool.run(code, stream=False)
    assert result.results == {0: "{'rank': 0}", 1: "{'rank': 1}"}
    assert result.result_data[1]["text/plain"] == "{'rank': 1}"
    for rank in (0, 1):
        assert [d["data"]["text/html"] for d in result.displays[rank]] == [f"<b>rank {rank}</b>"]


def test_run_output_is_tagged_by_rank(pool: Pool, capsys):
    result = pool.run(
        "import sys\nprint(f'hello from {rank} of {world_size}')\n"
        "print(f'warning {rank}', file=sys.stderr)"
    )
    out, err = capsys.readouterr()
    assert "[rank 0] hello from 0 of 2\n" in out
    assert "[rank 1] hello from 1 of 2\n" in out
    assert "[rank 0:stderr] warning 0\n" in err
    assert "[rank 1:stderr] warning 1\n" in err
    assert result.stdout == {0: "hello from 0 of 2\n", 1: "hello from 1 of 2\n"}
    assert result.stderr == {0: "warning 0\n", 1: "warning 1\n"}


def test_run_streams_output_while_ranks_are_still_running(pool: Pool, marker_dir: Path):
    # Each rank prints, then blocks until the notebook side has *received* that line:
    # this only finishes if output is delivered while the run is in flight.
    seen: list[tuple[int, str]] = []

    def sink(rank: int, stream: str, text: str) -> None:
        seen.append((rank, text))
        if "waiting" in text:
            (marker_dir / f"seen{rank}").touch()

    code = (
        "import os, time\n"
        f"marker = os.path.join({str(marker_dir)!r}, f'seen{{rank}}')\n"
        "print('waiting', flush=True)\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists(marker):\n"
        "    assert time.monotonic() < deadline, 'output was not streamed'\n"
        "    time.sleep(0.05)\n"
        "print('released')\n"
    )
    pool.run(code, on_output=sink, timeout=90)
    for rank in (0, 1):
        texts = "".join(t for r, t in seen if r == rank)
        assert texts == "waiting\nreleased\n"


def test_run_on_a_subset_of_ranks(pool: Pool, capsys):
    result = pool.run("print('only me', rank)", targets=[1])
    assert result.ranks == [1]
    assert "[rank 1] only me 1" in capsys.readouterr().out
    assert pool.run("rank", targets=0, stream=False).results == {0: "0"}


def test_an_error_on_one_rank_names_it_with_its_traceback(pool: Pool):
    with pytest.raises(RankError) as info:
        pool.run(
            "def check(r):\n    if r == 1:\n        raise ValueError(f'bad rank {r}')\ncheck(rank)"
        )
    err = info.value
    assert err.ranks == [1]
    assert err.errors[1] == ("ValueError", "bad rank 1")
    text = str(err)
    assert text.startswith("rank 1 raised; rank 1:")
    assert "check(rank)" in text and "raise ValueError(f'bad rank {r}')" in text
    # the pool is still usable afterwards
    assert pool.run("rank", stream=False).results == {0: "0", 1: "1"}


def test_identical_errors_are_collapsed(pool: Pool):
    with pytest.raises(RankError) as info:
        pool.run("1 / 0", stream=False)
    text = str(info.value)
    assert info.value.ranks == [0, 1]
    assert text.startswith("ranks 0, 1 raised; ranks 0, 1:")
    assert text.count("ZeroDivisionError: division by zero") == 1


def _times_rank_plus(offset, scale=1):
    import torch.distributed as dist

    return (dist.get_rank() + offset) * scale


def test_call_returns_results_in_rank_order(pool: Pool):
    assert pool.call(_times_rank_plus, 10) == [10, 11]
    assert pool.call(_times_rank_plus, 10, scale=2, targets=[1]) == [22]
    assert pool.call(lambda x: x * 2, 21) == [42, 42]


def _all_reduce_rank() -> list[float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.tolist()


def test_call_runs_collectives_on_all_ranks_concurrently(pool: Pool):
    assert pool.call(_all_reduce_rank, timeout=60) == [[3.0], [3.0]]


def test_call_error_is_a_rank_error(pool: Pool):
    def fail_on_zero():
        import torch.distributed as dist

        if dist.get_rank() == 0:
            raise KeyError("missing")
        return "ok"

    with pytest.raises(RankError) as info:
        pool.call(fail_on_zero)
    assert info.value.ranks == [0]
    assert info.value.errors[0][0] == "KeyError"


def test_push_and_pull(pool: Pool):
    pool.push({"alpha": 1.5, "names": ["a", "b"]})
    assert pool.pull("alpha") == [1.5, 1.5]
    pool.push({"alpha": 7}, targets=[1])
    assert pool.pull("alpha") == [1.5, 7]
    assert pool.pull("names", targets=1) == [["a", "b"]]
    assert pool.run("alpha * 2", stream=False).results == {0: "3.0", 1: "14"}
    with pytest.raises(RankError, match="NameError"):
        pool.pull("never_defined_anywhere")


def test_bad_call_arguments(pool: Pool):
    with pytest.raises(ValueError, match=r"targets must be ranks in 0\.\.1"):
        pool.run("1", targets=[2])
    with pytest.raises(ValueError, match="targets must be"):
        pool.run("1", targets=[])
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        pool.run("1", timeout=-1)
    with pytest.raises(TypeError, match="code must be a string"):
        pool.run(123)
    with pytest.raises(TypeError, match="fn must be callable"):
        pool.call("not a function")
    with pytest.raises(ValueError, match="name must be a variable name"):
        pool.pull("not a name")
    with pytest.raises(TypeError, match="mapping of variable names"):
        pool.push(["x"])


def test_topology_records_every_rank(pool: Pool):
    topology = pool.topology
    assert [r.rank for r in topology] == [0, 1]
    assert [r.local_rank for r in topology] == [0, 1]
    assert {r.host for r in topology} == {socket.gethostname()}
    assert {r.device for r in topology} == {"cpu"}
    assert {r.backend for r in topology} == {"gloo"}
    assert {r.world_size for r in topology} == {2}
    assert len({r.engine_id for r in topology}) == 2
    assert pool.call(os.getpid) == [r.pid for r in topology]
    table = pool.topology_table().splitlines()
    assert table[0].split()[:4] == ["rank", "local_rank", "host", "pid"]
    assert len(table) == 4


def _torchrun_env() -> dict[str, str | None]:
    import os

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {key: os.environ.get(key) for key in keys}


def test_ranks_have_torchrun_environment(pool: Pool):
    envs = pool.call(_torchrun_env)
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        # One host: the rendezvous store is a file in the pool's private folder, no port.
        assert env["MASTER_PORT"] is None


def test_engines_run_in_their_own_session(pool: Pool):
    own = os.getsid(0)
    for record in pool.topology:
        assert os.getsid(record.pid) != own
        assert os.getsid(record.pid) == record.pid  # session leader: start_new_session


def test_listeners_are_loopback_only_and_connection_files_private(pool: Pool, profile_dir: str):
    pids = [pid for pid in pool.launched_pids if psutil.pid_exists(pid)]
    listening = []
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        listening += [c.laddr for c in connections if c.status == psutil.CONN_LISTEN]
    assert listening, "expected the controller, schedulers and ranks to listen"
    assert {addr.ip for addr in listening} == {"127.0.0.1"}

    security = Path(profile_dir) / "security"
    files = sorted(security.glob("ipcontroller-*.json"))
    assert files
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        info = json.loads(path.read_text())
        assert info["key"], "messages must be signed"
        assert info["signature_scheme"].startswith("hmac-")


def test_start_is_idempotent_and_repr_names_state(pool: Pool):
    pids = [r.pid for r in pool.topology]
    assert pool.start() is pool
    assert [r.pid for r in pool.topology] == pids
    assert "running" in repr(pool)
