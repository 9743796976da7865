"""A start whose engines do not all register, with real engines and faults injected into
their start-up (:mod:`tests.pool.faulty_engine`): the engines the controller registered
are counted even when the client missed their notifications; an engine that exits
before registering is started once more, and the start says so; one that hangs is named
in the error, alive, with its stack and its log, after its one retry hung too."""

from __future__ import annotations

import glob
import os
import re
import socket
import time
from pathlib import Path

import ipyparallel as ipp
import pytest
import zmq

from fsdp_interactive.pool import Pool, PoolStartError
from fsdp_interactive.pool.processes import _engine_entry, _engine_starts
from tests.pool import faulty_engine
from tests.pool.conftest import record, wait_gone


def _faulty_engines(monkeypatch: pytest.MonkeyPatch, folder: Path, fault: str) -> None:
    """The pool's forked engines run :mod:`tests.pool.faulty_engine` with ``fault``."""
    real = _engine_entry.engine_command

    def command(connection_file: str, wait_s: float) -> list[str]:
        argv = real(connection_file, wait_s)
        assert argv[1:3] == ["-m", "fsdp_interactive.pool.processes._engine_entry"]
        return [argv[0], "-m", "tests.pool.faulty_engine", *argv[3:]]

    monkeypatch.setattr(_engine_starts, "engine_command", command)
    monkeypatch.setenv("FSDPI_TEST_FAULT_DIR", str(folder))
    monkeypatch.setenv("FSDPI_TEST_FAULT", fault)


def _faults(folder: Path) -> dict[int, str]:
    """pid -> the fault each engine ran with ("none", "stall", "exit")."""
    return {int(p.name.split("-", 1)[1]): p.read_text() for p in folder.glob("engine-*")}


def _rank_pid() -> int:
    return os.getpid()


def test_engines_whose_registration_the_client_missed_are_counted(tmp_path, monkeypatch):
    # ipyparallel's client subscribes to registration notifications only after its
    # connection reply: held back until the controller registered both engines, its
    # subscription misses both notifications, as it missed one now and then on a loaded
    # machine (the start then waited out its timeout with "only 0 of 2 registered").
    import ipyparallel.client.client as client_module

    profile = tmp_path / "profile"
    real_connect = client_module.util.connect
    held: list[str] = []

    def connect(sock, url, **kwargs):
        if sock.type == zmq.SUB and not held:
            held.append(url)
            _wait_until_registered(profile, 2)
        return real_connect(sock, url, **kwargs)

    monkeypatch.setattr(client_module.util, "connect", connect)
    pool = Pool(2, devices="cpu", timeout=60, profile_dir=str(profile), show_topology=False)
    try:
        pool.start()
        assert held, "the client's notification socket was not held back"
        assert pool.world_size == 2
        assert sorted(pool.call(_rank_pid)) == sorted(r.pid for r in pool.topology)
    finally:
        record(pool)
        pool.stop()


def _wait_until_registered(profile: Path, n: int, timeout: float = 120.0) -> None:
    """Until the controller of the cluster in ``profile`` has ``n`` engines registered,
    asked through clients of its own (their connection replies list them)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = glob.glob(str(profile / "security" / "ipcontroller-*-client.json"))
        if files:
            client = ipp.Client(files[0], timeout=10)
            try:
                if len(client.ids) >= n:
                    return
            finally:
                client.close()
        time.sleep(0.2)
    raise AssertionError(f"the controller did not register {n} engines within {timeout}s")


def test_an_engine_that_exits_before_registering_is_started_once_more(
    profile_dir, tmp_path, monkeypatch, capsys
):
    _faulty_engines(monkeypatch, tmp_path, "exit-first")
    pool = Pool(2, devices="cpu", timeout=60, profile_dir=profile_dir, show_topology=False)
    try:
        pool.start()
        shown = capsys.readouterr().out
        exited = [pid for pid, fault in _faults(tmp_path).items() if fault == "exit"]
        assert len(exited) == 1, _faults(tmp_path)
        host = re.escape(socket.gethostname())
        assert re.search(
            rf"engine \d \(pid {exited[0]} on host {host}\) exited before registering "
            r"\(exit code 3\); starting it once more",
            shown,
        ), shown
        assert pool.world_size == 2 and exited[0] not in [r.pid for r in pool.topology]
        assert sorted(pool.call(_rank_pid)) == sorted(r.pid for r in pool.topology)
    finally:
        record(pool)
        pool.stop()


@pytest.mark.timing
def test_an_engine_that_hangs_before_registering_is_named_alive_with_its_stack_and_log(
    profile_dir, tmp_path, monkeypatch, capsys
):
    # One engine registers; the other stalls before registering, and so does its retry.
    _faulty_engines(monkeypatch, tmp_path, "stall-after-first")
    pool = Pool(2, devices="cpu", timeout=30, profile_dir=profile_dir, show_topology=False)
    with pytest.raises(PoolStartError) as failed:
        pool.start()
    record(pool)
    message = str(failed.value)
    shown = capsys.readouterr().out
    stalled = {pid for pid, fault in _faults(tmp_path).items() if fault == "stall"}
    assert len(stalled) == 2, _faults(tmp_path)
    host = re.escape(socket.gethostname())

    assert message.startswith("only 1 of 2 engines registered within timeout=30s"), message
    named = re.search(
        rf"^engine (\d)-retry \(pid (\d+) on host {host}\): alive, not registered; "
        r"in stall_before_registering \(faulty_engine\.py:\d+\)",
        message,
        re.MULTILINE,
    )
    assert named, message
    index, retry_pid = named.group(1), int(named.group(2))
    first = re.search(
        rf"^engine {index}-retry was the retry of:\nengine {index} \(pid (\d+) on host {host}\): "
        r"alive, not registered; in stall_before_registering",
        message,
        re.MULTILINE,
    )
    assert first, message
    assert {retry_pid, int(first.group(1))} == stalled
    # Each one's stack, read with py-spy, with source lines, and the end of its log.
    stack_line = (
        re.escape(f'File "{faulty_engine.__file__}"')
        + r", line \d+, in stall_before_registering\n\s+time\.sleep\(0\.5\)"
    )
    assert len(re.findall(stack_line, message)) == 2, message
    assert message.count("last lines of its log") == 2, message
    assert message.count(faulty_engine.STALL_LINE) == 2, message
    # The retry was announced while the start ran.
    assert re.search(
        rf"engine {index} \(pid {first.group(1)} on host {host}\) did not register within "
        r"\d+s while the others did \(alive; in stall_before_registering",
        shown,
    ), shown
    assert "starting it once more" in shown
    assert pool.state == "stopped"
    assert wait_gone(pool.launched_pids) == []
