"""The parts of an attachable rank in this process: the step boundary, cells on a paused
thread, the records and their folder, the service's listeners and bounds."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdp_interactive import _attach_records
from fsdp_interactive.pool.common import _agent_wire, _secure_link
from fsdp_interactive.pool.rank import _attach_service, _step_boundary
from fsdp_interactive.pool.rank._attach_service import AttachOptions
from fsdp_interactive.pool.rank._paused_cells import CellNamespace, code_name, run_cell


def _train(optimizer: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()  # the training loop's line: where a stop is seen from
        optimizer.zero_grad()


def test_the_boundary_counts_any_optimizer_follows_one_and_stops_after_the_asked_step():
    boundary = _step_boundary.StepBoundary()
    handle = register_optimizer_step_post_hook(boundary.after_step)
    try:
        model = torch.nn.Linear(4, 4)
        adam = torch.optim.Adam(model.parameters())
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        stops = []

        def on_stop(point: _step_boundary.StopPoint) -> None:
            stops.append((point.step, point.thread, point.frame.f_code.co_name, point.optimizer))
            sgd.step()  # a step taken while stopped: not the job's, not counted, no stop

        assert boundary.stop_at(3, on_stop) == 0
        _train(adam, model, 2)
        _train(sgd, model, 2)  # another optimizer: not followed
        assert boundary.count == 2 and not stops
        _train(adam, model, 2)
        assert boundary.count == 4
        assert stops == [(3, threading.get_ident(), "_train", adam)]
        assert boundary.stop_at(3, on_stop) == 4  # passed: the request stays, it never fires
        _train(adam, model, 1)
        assert len(stops) == 1
        with pytest.raises(ValueError, match="step must be an optimizer step number >= 1"):
            boundary.stop_at(0, on_stop)
    finally:
        handle.remove()


def test_cells_see_the_paused_frames_locals_over_main_and_never_rebind_the_jobs_names():
    shared = [1, 2]
    lr = 0.5
    namespace = CellNamespace({"main_name": "from __main__", "lr": 9}, sys._getframe())
    outcome = run_cell(
        "print(main_name)\nlr = 0.1\nsquares = [x * x * lr for x in shared]\nsquares", 7, namespace
    )
    assert outcome.error is None, outcome.traceback
    assert outcome.stdout == "from __main__\n" and outcome.result == "[0.1, 0.4]"
    assert namespace.lookup("lr") == 0.1 and namespace.lookup("squares") == [0.1, 0.4]
    assert lr == 0.5  # the frame's own variable
    shared_again = run_cell("shared.append(3)\ndel squares", 8, namespace)
    assert shared_again.error is None and shared == [1, 2, 3]  # objects are the job's
    with pytest.raises(KeyError):
        namespace.lookup("squares")
    failed = run_cell("def f():\n    return 1 / 0\nf()", 9, namespace)
    assert failed.error == ("ZeroDivisionError", "division by zero")
    assert 'File "<cell In[9]>", line 3, in <module>' in failed.traceback
    assert "return 1 / 0" in failed.traceback and "_paused_cells" not in failed.traceback
    assert code_name("<cell In[9]>") == "Cell In[9]" and code_name("train.py") is None


def test_another_threads_output_is_not_taken_by_a_cell(capsys):
    namespace = CellNamespace({}, None)
    code = (
        "import threading, sys\n"
        "t = threading.Thread(target=lambda: print('from another thread'))\n"
        "t.start(); t.join()\n"
        "print('from the cell'); print('err', file=sys.stderr)"
    )
    outcome = run_cell(code, 1, namespace)
    assert (outcome.stdout, outcome.stderr) == ("from the cell\n", "err\n")
    assert "from another thread" in capsys.readouterr().out


def test_job_names_come_from_slurm_or_torchrun_and_the_default_folder_is_private(
    tmp_path, monkeypatch
):
    assert _attach_records.job_name({"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "2"}) == "slurm-41.2"
    assert _attach_records.job_name({"SLURM_JOB_ID": "41"}) == "slurm-41"
    assert _attach_records.job_name({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun-abc"
    assert (
        _attach_records.job_name(
            {"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
        )
        == f"torchrun-{os.getppid()}"
    )
    assert _attach_records.job_name({}) == f"pid-{os.getpid()}"
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o755)
    monkeypatch.delenv(_attach_records.DIR_ENV, raising=False)
    monkeypatch.setenv(_attach_records.RUNTIME_DIR_ENV, str(runtime))
    assert _attach_records.default_attach_dir().endswith(
        f"fsdpi-attach-{os.geteuid()}"
    )  # not private
    runtime.chmod(0o700)
    assert _attach_records.default_attach_dir() == str(runtime / "fsdpi-attach")
    with pytest.raises(ValueError, match="a job name is a plain folder name"):
        _attach_records.check_job_name("../x")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(_attach_records._private_files.NotPrivateError, match="has mode 0755"):
        _attach_records.read_job(str(shared))
    with pytest.raises(ValueError, match="longer than a Unix socket allows"):
        _attach_records.socket_path("/" + "x" * 120, 0)


def test_a_rank_listens_on_tcp_only_where_asked_over_tls_and_pause_timeouts_are_bounded(
    tmp_path,
):
    for bad, match in (
        (AttachOptions(pause_timeout=0), "pause_timeout must be seconds"),
        (AttachOptions(pause_timeout=10**6), "pause_timeout must be seconds"),
        (AttachOptions(listen="0.0.0.0"), "would listen on every interface"),
        (AttachOptions(job="a/b"), "a job name is a plain folder name"),
    ):
        with pytest.raises(ValueError, match=match):
            bad.checked()
    folder = tmp_path / "attach"
    service = _attach_service.AttachService(
        AttachOptions(attach_dir=str(folder), job="unit", listen="127.0.0.1"), threading.get_ident()
    )
    try:
        record = service.start()
        assert record.address is not None and record.address[0] == "127.0.0.1"
        assert _attach_records.read_job(str(folder / "unit")) == [record]
        with pytest.raises(multiprocessing.AuthenticationError):
            _agent_wire.connect(record.address, b"wrong key", 5.0)
        for address in (record.address, record.socket):
            conn = _agent_wire.connect(address, record.key_bytes, 5.0)
            # TCP: TLS with the rank's key bound to the session; the private socket: plain
            assert isinstance(conn, _secure_link.SecureLink) == (address == record.address)
            _agent_wire.send(conn, {"op": "status"})
            assert conn.recv()["state"].pid == os.getpid()
            _agent_wire.send(conn, {"op": "pause", "session": "nobody's", "step": 1})
            assert "NotAttached" in conn.recv()["error"]  # control needs the session
            _agent_wire.send(conn, {"op": "fault_link"})  # it would install a signal handler
            assert "keeps no fault_link" in conn.recv()["error"]
            conn.close()
        # A plain connection on TCP, with the key: the job's requests are refused.
        plain = _agent_wire.connect(record.address, record.key_bytes, 5.0, secure=False)
        for op in ("status", "session", "stacks"):
            _agent_wire.send(plain, {"op": op, "session": "s", "client": {}})
            assert "only over TLS" in plain.recv()["error"]
        plain.close()
    finally:
        service.close()
    assert not (folder / "unit").exists()


_SCRIPT = """
import json, os, sys
import fsdp_interactive
from fsdp_interactive import _attach_records
service = fsdp_interactive.attachable()  # the running one: the entry made it
records = _attach_records.read_job(os.path.join(sys.argv[1], "solo"))
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0],
                  "pid": records[0].pid == os.getpid(), "same": service.record == records[0]}))
"""


def test_the_entry_runs_a_script_or_a_module_as_main_with_its_arguments(tmp_path):
    import json
    import subprocess

    folder = tmp_path / "attach"
    (tmp_path / "job.py").write_text(_SCRIPT)
    (tmp_path / "jobmodule.py").write_text(_SCRIPT)
    entry = [sys.executable, "-m", "fsdp_interactive.attachable", "--attach-dir", str(folder)]
    for target, expected_argv0 in (
        ([str(tmp_path / "job.py")], str(tmp_path / "job.py")),
        (["-m", "jobmodule"], "jobmodule"),
    ):
        done = subprocess.run(
            [*entry, "--job-name", "solo", *target, str(folder), "--flag"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        assert seen["argv"][1:] == [str(folder), "--flag"] and seen["name"] == "__main__"
        assert seen["pid"] and seen["same"]
        if target[0] != "-m":
            assert seen["argv"][0] == expected_argv0 and seen["path0"] == str(tmp_path)
    assert not (folder / "solo").exists()  # removed as the process ended
    bad = subprocess.run(
        [*entry, "--pause-timeout", "0", "x.py"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "pause_timeout must be seconds" in bad.stderr


def test_attachable_is_callable_as_the_package_names_it():
    import fsdp_interactive
    import fsdp_interactive.attachable as module

    assert callable(module) and callable(fsdp_interactive.attachable)
