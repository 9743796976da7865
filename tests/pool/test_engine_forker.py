"""The engine forker: a real forker process, driven through the pool's own handle on it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool.processes._forked_children import check_request
from fsdp_interactive.pool.processes._forked_launcher import (
    EngineForker,
    ForkerError,
    forker_command,
)
from fsdp_interactive.pool.processes._forker_setup import ForkerSetup

CHILD = [sys.executable, "-m", "tests.pool.forker_child"]


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("forker") / "forker.log"
    env = dict(os.environ, FORKER_TEST_ONLY_IN_FORKER="yes")
    env.pop("FSDPI_SNAPSHOT_ROOT", None)  # a forker without a snapshot root
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


def test_the_forker_says_when_it_is_ready(forker):
    assert forker.ready.wait(120)
    assert forker.remote_pid == forker.pid  # on this host, the forker is the process itself
    assert forker.ready_s is not None and forker.ready_s > 0


def test_a_child_can_extend_the_forkers_environment_and_run_in_its_directory(forker, tmp_path):
    """What engines on other hosts are given: their own variables on top of the host's
    environment, the forker's working directory, their output sent back as they end."""
    log = tmp_path / "collected.log"
    pid = asyncio.run(
        forker.fork(
            [*CHILD, "5"],
            {"FORKER_TEST_MARKER": "added"},
            None,
            str(log),
            extend_env=True,
            collect_output=True,
        )
    )
    ended = threading.Event()
    codes: list[int | None] = []
    forker.on_exit(pid, lambda code: (codes.append(code), ended.set()))
    assert ended.wait(60) and codes == [5]
    output = forker.take_output(pid)
    assert output is not None and not log.exists()  # sent back, then removed
    report = json.loads(next(line for line in output.splitlines() if line.startswith("{")))
    assert report["marker"] == "added"
    assert report["inherited"] == "yes"  # the forker's own environment, extended
    assert report["cwd"] == os.getcwd()  # the forker's, which it got from this process
    assert report["snapshot_root"] is None  # this forker has none


def test_signal_requests_reach_only_the_forkers_own_children(forker, tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child = Child(forker, ["sleep"], tmp_path / "child.log", tmp_path)
        child.report()  # running
        forker.signal(bystander.pid, signal.SIGTERM)  # not its child: ignored
        forker.signal(child.pid, signal.SIGTERM)
        assert child.wait() == -signal.SIGTERM
        forker.signal(child.pid, signal.SIGTERM)  # reaped: ignored, whoever has the pid now
        time.sleep(0.5)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(30)


def _forker_with_root(tmp_path: Path, *, adopt: bool = False) -> tuple[EngineForker, Path]:
    root = tmp_path / "fsdpi-test-root"
    forker = EngineForker(
        str(tmp_path / "forker.log"),
        dict(os.environ),
        command=forker_command(),
        setup=ForkerSetup(str(root), adopt=adopt),
    )
    return forker, root


def _snapshot_in(root: Path) -> None:
    """A snapshot in the root, once the forker made it (first thing it does)."""
    end = time.monotonic() + 60
    while not root.exists() and time.monotonic() < end:
        time.sleep(0.01)
    (root / "s000001").mkdir()
    (root / "s000001" / "manifest.json").write_text("{}")


def test_the_forker_makes_the_root_private_and_it_is_on_no_command_line(tmp_path):
    forker, root = _forker_with_root(tmp_path)
    try:
        assert forker.ready.wait(120)
        assert forker.root_made == "created" and forker.root_refused is None
        info = root.lstat()
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == os.geteuid()
        assert str(root) not in " ".join(psutil.Process(forker.pid).cmdline())
    finally:
        forker.close()
    assert not root.exists()


def test_a_forker_refuses_a_root_that_exists_and_forks_nothing(tmp_path):
    root = tmp_path / "fsdpi-test-root"
    root.mkdir()
    (root / "planted").write_text("not ours to remove")
    forker, _ = _forker_with_root(tmp_path)
    try:
        assert forker.ready.wait(120)
        assert forker.root_made is None and "exists already" in forker.root_refused
        with pytest.raises(ForkerError, match="refusing the pool's snapshot root"):
            Child(forker, ["sleep"], tmp_path / "child.log", tmp_path)
    finally:
        forker.close()
    assert (root / "planted").read_text() == "not ours to remove"  # refused: never removed


def test_a_replacing_forker_adopts_the_private_root_of_the_one_before(tmp_path):
    first, root = _forker_with_root(tmp_path)
    try:
        _snapshot_in(root)
        os.kill(first.pid, signal.SIGKILL)  # gone without removing its root
        first._proc.wait(30)
    finally:
        first.close()
    second, _ = _forker_with_root(tmp_path, adopt=True)
    try:
        assert second.ready.wait(120) and second.root_made == "adopted"
        assert (root / "s000001" / "manifest.json").exists()
    finally:
        second.close()
    assert not root.exists()


def test_closing_the_forker_ends_its_children_and_removes_the_snapshot_root(tmp_path):
    forker, root = _forker_with_root(tmp_path)
    try:
        child = Child(forker, ["sleep"], tmp_path / "child.log", tmp_path)
        assert child.report()["snapshot_root"] == str(root)  # handed to every child
        _snapshot_in(root)
        forker.close(timeout=30)
        assert child.wait() == -signal.SIGTERM  # ended, and its end still reported
        assert not psutil.pid_exists(child.pid)
        assert not root.exists()
        assert "removed the snapshot root" in (tmp_path / "forker.log").read_text()
    finally:
        forker.close()


def test_sigterm_to_the_forker_ends_its_children_and_removes_the_snapshot_root(tmp_path):
    forker, root = _forker_with_root(tmp_path)
    try:
        child = Child(forker, ["sleep"], tmp_path / "child.log", tmp_path)
        child.report()
        _snapshot_in(root)
        os.kill(forker.pid, signal.SIGTERM)
        assert child.wait() == -signal.SIGTERM
        assert forker._proc.wait(30) == 0  # a clean exit, not death by the signal
        assert not root.exists()
    finally:
        forker.close()


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (sig - 1)))


def test_a_forker_that_ends_while_importing_removes_the_snapshot_root(tmp_path):
    forker, root = _forker_with_root(tmp_path)
    try:
        _snapshot_in(root)
        end = time.monotonic() + 60
        while not _catches(forker.pid, signal.SIGTERM) and time.monotonic() < end:
            time.sleep(0.01)
        assert not forker.ready.is_set()  # torch takes seconds to import: still at it
        os.kill(forker.pid, signal.SIGTERM)
        assert forker._proc.wait(60) == 0
        assert not forker.ready.is_set()
        assert not root.exists()
    finally:
        forker.close()


def test_a_forker_killed_by_sigkill_leaves_the_root_to_the_reaper(tmp_path):
    forker, root = _forker_with_root(tmp_path)
    try:
        assert forker.ready.wait(120)
        _snapshot_in(root)
        os.kill(forker.pid, signal.SIGKILL)
        assert forker._proc.wait(30) == -signal.SIGKILL
        assert (root / "s000001" / "manifest.json").exists()
    finally:
        forker.close()


def _ended(pid: int, timeout: float = 30.0) -> None:
    """Wait until child ``pid`` of this process has ended, without reaping it."""
    end = time.monotonic() + timeout
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < end, f"child {pid} did not end"
        time.sleep(0.01)


def test_a_child_reaped_while_its_event_waited_in_the_batch_is_not_reaped_again():
    # The forker's loop reaps the children whose pidfds one select() reported, in turn;
    # reaping the first runs code (a warm import's SIGCHLD handler) that reaps the second
    # already. The second's event is then stale: the forker used to crash on it (KeyError),
    # failing the next start with "the engine forker ended with status 1".
    from fsdp_interactive.pool.processes import _engine_forker
    from fsdp_interactive.pool.processes._forked_children import fork_child
    from fsdp_interactive.pool.processes._forker_setup import RootState

    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    server = _engine_forker._Server(requests_r, replies_w, RootState())
    try:
        first = fork_child(lambda: 0, os.devnull, server.own_descriptors())
        second = fork_child(lambda: 0, os.devnull, server.own_descriptors())
        _ended(first)
        _ended(second)
        second_child = _engine_forker._Child(second, report=True)

        def reap_the_second(code: int) -> None:
            pidfd = next(fd for fd, child in server.children.items() if child is second_child)
            server.reap(pidfd)

        server.watch(_engine_forker._Child(first, report=False, on_end=reap_the_second))
        server.watch(second_child)
        os.close(requests_w)  # then the loop returns, once both ends were handled
        server.serve()
        replies = [json.loads(line) for line in os.read(replies_r, 65536).splitlines()]
        assert replies == [{"exited": second, "exit_code": 0}]
        assert server.children == {}
    finally:
        server.close()
        for fd in (requests_r, replies_r, replies_w):
            os.close(fd)
