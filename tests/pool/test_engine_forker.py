"""The engine forker: a real forker process, driven through the pool's own handle on it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool._engine_forker import check_request
from fsdp_interactive.pool._forked_launcher import EngineForker, ForkerError

CHILD = [sys.executable, "-m", "tests.pool.forker_child"]


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("forker") / "forker.log"
    env = dict(os.environ, FORKER_TEST_ONLY_IN_FORKER="yes")
    handle = EngineForker(str(log), env)
    try:
        yield handle
    finally:
        handle.close()
        assert not handle.running()


class Child:
    """One forked child: its pid, exit code (once ended) and printed report."""

    def __init__(
        self,
        forker: EngineForker,
        args: list[str],
        output: Path,
        cwd: Path,
        nanny: bool = False,
    ):
        self.output = output
        self.exited = threading.Event()
        self.exit_code: int | None = None
        env = dict(os.environ, FORKER_TEST_MARKER=f"marker-{output.name}")
        self.pid = asyncio.run(
            forker.fork([*CHILD, *args], env, str(cwd), str(output), nanny=nanny)
        )
        forker.on_exit(self.pid, self._ended)

    def _ended(self, code: int | None) -> None:
        self.exit_code = code
        self.exited.set()

    def wait(self, timeout: float = 60) -> int | None:
        assert self.exited.wait(timeout), f"child {self.pid} did not end within {timeout}s"
        return self.exit_code

    def report(self, timeout: float = 60) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.output.read_text() if self.output.exists() else ""
            lines = [line for line in text.splitlines() if line.startswith("{")]
            if lines:
                return json.loads(lines[0])
            time.sleep(0.05)
        raise AssertionError(f"child {self.pid} printed no report within {timeout}s")


def test_a_forked_child_runs_the_module_like_a_fresh_process(forker, tmp_path):
    child = Child(forker, ["3"], tmp_path / "child.log", tmp_path)
    assert child.wait() == 3
    report = child.report()
    assert report["pid"] == child.pid
    assert report["sid"] == child.pid  # its own session, like ipyparallel's local launcher
    assert report["cwd"] == str(tmp_path)
    assert report["argv"] == ["3"]
    assert report["stdin"] == ""  # stdin is /dev/null, not the forker's request pipe
    # exactly the environment it was given, not the forker's own
    assert report["marker"] == "marker-child.log"
    assert report["inherited"] is None
    assert report["torch_preloaded"] is True
    # signal dispositions of a fresh interpreter: Ctrl-C raises, SIGPIPE is ignored
    assert report["sigint_raises"] and report["sigpipe_ignored"]
    assert report["nanny_fds"] == []  # no nanny asked for


def test_an_engine_request_forks_a_nanny_that_ends_quietly_when_left_unused(forker, tmp_path):
    """The nanny waits, in its own session, on pipes only the child holds the other ends
    of; a child that ends without handing it arguments takes the nanny with it."""
    log = tmp_path / "child.log"
    child = Child(forker, ["sleep"], log, tmp_path, nanny=True)
    report = child.report()
    assert len(report["nanny_fds"]) == 2 and report["nanny_fds_open"] == [True, True]
    (nanny,) = [p for p in psutil.Process(forker.pid).children() if p.pid != child.pid]
    assert nanny.ppid() == forker.pid and os.getsid(nanny.pid) == nanny.pid
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    end = time.monotonic() + 30
    while psutil.pid_exists(nanny.pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not psutil.pid_exists(nanny.pid)  # ended, and reaped by the forker
    assert "Traceback" not in log.read_text()
    # Later children inherit none of those pipes.
    plain = Child(forker, ["0"], tmp_path / "plain.log", tmp_path)
    assert plain.wait() == 0 and plain.report()["nanny_fds"] == []


def test_a_child_killed_by_a_signal_reports_the_negative_signal(forker, tmp_path):
    child = Child(forker, ["sleep"], tmp_path / "child.log", tmp_path)
    child.report()  # running
    assert psutil.Process(child.pid).ppid() == forker.pid
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert not psutil.pid_exists(child.pid)  # reaped by the forker, no zombie left


def test_children_get_their_own_numpy_random_state(forker, tmp_path):
    first = Child(forker, ["0"], tmp_path / "a.log", tmp_path)
    second = Child(forker, ["0"], tmp_path / "b.log", tmp_path)
    assert first.wait() == 0 and second.wait() == 0
    assert first.report()["draw"] != second.report()["draw"]


def test_output_is_appended_to_the_log_file(forker, tmp_path):
    log = tmp_path / "child.log"
    log.write_text("earlier line\n")
    child = Child(forker, ["0"], log, tmp_path)
    assert child.wait() == 0
    text = log.read_text()
    assert text.startswith("earlier line\n") and '"argv": ["0"]' in text


def test_a_malformed_request_is_refused_and_the_forker_keeps_serving(forker, tmp_path):
    with pytest.raises(ForkerError, match=r"argv must be \[python, '-m', module"):
        asyncio.run(forker.fork([sys.executable, "-c", "pass"], {}, str(tmp_path), "x.log"))
    with pytest.raises(ForkerError, match="cwd and output must be strings"):
        asyncio.run(forker.fork(CHILD, {}, str(tmp_path), ""))
    request = {"argv": CHILD, "env": {}, "cwd": str(tmp_path), "output": "x.log", "nanny": 1}
    with pytest.raises(ValueError, match="nanny must be true or false"):
        check_request(request)
    child = Child(forker, ["0"], tmp_path / "child.log", tmp_path)
    assert child.wait() == 0


def test_closing_the_forker_ends_it_and_fails_later_requests(tmp_path):
    forker = EngineForker(str(tmp_path / "forker.log"), dict(os.environ))
    forker.close()
    assert not forker.running()
    with pytest.raises(ForkerError, match=f"engine forker \\(pid {forker.pid}\\) ended"):
        asyncio.run(forker.fork(CHILD, dict(os.environ), str(tmp_path), str(tmp_path / "c.log")))
