"""Faults around an attached job: a notebook that dies while the job is paused, a rank
that dies while attached, a second notebook, a second user, a wrong key."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import fsdp_interactive
from fsdp_interactive import _attach_records
from fsdp_interactive.pool import AttachError, JobError, JobRanksGone
from fsdp_interactive.pool.common import _agent_wire
from tests.pool.attach_jobs import TorchrunJob, same_bits
from tests.second_user import OtherUserError, as_other_user

pytestmark = pytest.mark.timing

_NOTEBOOK = """
import json, sys, time
import fsdp_interactive
job = fsdp_interactive.attach(sys.argv[1])
step = job.pause(at_step=int(sys.argv[2])) if sys.argv[2] != "-" else None
print(json.dumps({"paused": job.paused_step, "steps": [s.step for s in job.status().states.values()]}), flush=True)
time.sleep(600)
"""


def _notebook(folder: Path, at_step: int | None) -> tuple[subprocess.Popen[str], dict]:
    """A notebook in a process of its own, attached (and paused at ``at_step``); what it
    saw once it got there."""
    process = subprocess.Popen(
        [sys.executable, "-c", _NOTEBOOK, str(folder), str(at_step) if at_step else "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(30)
        raise AssertionError(
            f"the notebook process failed: {process.stderr.read() if process.stderr else ''}"
        )
    return process, json.loads(line)


def _killed(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def test_a_notebook_that_dies_while_the_job_is_paused_leaves_it_paused_for_its_timeout_only(
    tmp_path, unattached_run
):
    os.chmod(tmp_path, 0o700)
    args = ["--steps", "9", "--step-sleep", "0.05", "--out", str(tmp_path / "job.pt")]
    with TorchrunJob(tmp_path, 2, *args, pause_timeout=4) as job:
        job.wait_attachable()
        first, seen = _notebook(job.job_folder, 3)
        assert seen == {"paused": 3, "steps": [3, 3]}
        _killed(first)
        # within the job's timeout a notebook attaches again, no take-over needed, and
        # finds the job still paused after step 3; then it dies too
        second, seen = _notebook(job.job_folder, None)
        assert seen == {"paused": 3, "steps": [3, 3]}
        _killed(second)
        # nobody comes back: the ranks resume by themselves and the job ends as unattached
        assert job.wait() == 0, job.output()
    assert same_bits(unattached_run, tmp_path / "job.pt")


def test_a_rank_that_dies_while_attached_is_reported_and_torchrun_handles_it(tmp_path):
    os.chmod(tmp_path, 0o700)
    with TorchrunJob(
        tmp_path, 2, "--stop-file", str(tmp_path / "never"), "--step-sleep", "0.05"
    ) as job:
        records = job.wait_attachable()
        attached = fsdp_interactive.attach(job.job_folder)
        try:
            os.kill(records[1].pid, signal.SIGKILL)
            status = _eventually(
                lambda: (s := attached.status()).gone.get(1) == "gone (died)" and s
            )
            assert 1 not in status.states
            with pytest.raises(JobRanksGone, match=r"rank 1 \(on .*\) of job job died") as raised:
                attached.trace()
            assert 1 in raised.value.died
            assert "%fsdp detach" in raised.value.notebook_message()
        finally:
            attached.detach()
        code = job.wait()
    # torchrun's own handling: it ends the other rank and fails, naming the killed one
    assert code != 0
    assert "Signal 9 (SIGKILL)" in job.output() or "exitcode  : -9" in job.output(), job.output()[
        -3000:
    ]


def _eventually(
    condition, timeout: float = 60.0, errors: tuple[type[BaseException], ...] = (AssertionError,)
):
    end = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except errors:
            value = None
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def running_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    folder = tmp_path_factory.mktemp("attach-faults")
    os.chmod(folder, 0o700)
    stop = folder / "stop"
    # in the default attach dir of this user, as a job started without options is
    with TorchrunJob(
        folder,
        2,
        "--stop-file",
        str(stop),
        "--step-sleep",
        "0.05",
        attach_dir=Path(_attach_records.default_attach_dir()),
        name=f"faults-{os.getpid()}",
    ) as job:
        records = job.wait_attachable()
        try:
            yield SimpleNamespace(job=job, records=records)
        finally:
            stop.touch()
            job.wait()
    with contextlib.suppress(OSError):  # the default attach dir, when nothing else is in it
        os.rmdir(_attach_records.default_attach_dir())


def test_a_second_notebook_is_refused_until_it_asks_to_take_over(running_job):
    folder = running_job.job.job_folder
    first = fsdp_interactive.attach(folder)
    try:
        with pytest.raises(
            AttachError, match=rf"a notebook \(pid {os.getpid()} on .*\) attached .* take_over=True"
        ):
            fsdp_interactive.attach(folder)
        second = fsdp_interactive.attach(folder, take_over=True)
        with pytest.raises(JobError, match=r"another notebook took job .* over"):
            first.pause()
        assert second.pause() >= 1 and second.state == "paused"
        second.detach()
    finally:
        first.detach()


def test_another_user_cannot_attach_read_a_record_or_reach_a_rank(running_job):
    record = running_job.records[0]
    folder = str(running_job.job.job_folder)

    def attach_as_other() -> str:
        fsdp_interactive.attach(folder)
        return "attached"

    with pytest.raises(
        OtherUserError, match=r"AttachError: .*(Permission denied|not this user|only by the user)"
    ):
        as_other_user(attach_as_other)
    with pytest.raises(OtherUserError, match="PermissionError"):
        as_other_user(_attach_records.read_job, folder)
    with pytest.raises(OtherUserError, match="PermissionError"):
        as_other_user(_agent_wire.connect, record.socket, record.key_bytes, 5.0)
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    assert oct(os.stat(os.path.dirname(folder)).st_mode & 0o777) == "0o700"
    assert oct(os.stat(_attach_records.record_path(folder, 0)).st_mode & 0o777) == "0o600"


def test_a_wrong_key_is_refused_and_the_rank_serves_on(running_job):
    record = running_job.records[0]
    with pytest.raises(multiprocessing.AuthenticationError):
        _agent_wire.connect(record.socket, b"\x00" * 32, 5.0)
    conn = _agent_wire.connect(record.socket, record.key_bytes, 5.0)
    try:
        _agent_wire.send(conn, {"op": "status"})
        assert conn.recv()["state"].pid == record.pid
    finally:
        conn.close()
