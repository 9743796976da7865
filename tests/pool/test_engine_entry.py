"""The local engines' entry: wait for a complete controller connection file, then run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from fsdp_interactive.pool.processes._engine_entry import read_connection_info

DOCUMENT = {"key": "k", "interface": "tcp://127.0.0.1", "location": "127.0.0.1"}


def test_a_half_written_file_is_waited_for_until_it_is_complete(tmp_path):
    path = tmp_path / "ipcontroller-engine.json"
    text = json.dumps(DOCUMENT)
    path.write_text(text[: len(text) // 2])  # the controller writes it in place

    def finish() -> None:
        time.sleep(0.3)
        path.write_text(text)

    writer = threading.Thread(target=finish)
    writer.start()
    try:
        assert read_connection_info(str(path), wait_s=30) == text
    finally:
        writer.join()


def test_a_document_without_the_key_is_not_taken_as_complete(tmp_path):
    path = tmp_path / "ipcontroller-engine.json"
    path.write_text(json.dumps({"interface": "tcp://127.0.0.1"}))
    with pytest.raises(TimeoutError, match=r"ipcontroller-engine\.json did not appear"):
        read_connection_info(str(path), wait_s=0.2)


def _entry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_interactive.pool.processes._engine_entry", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_engine_whose_controller_never_writes_the_file_exits_and_says_why(tmp_path):
    missing = tmp_path / "never.json"
    result = _entry("--connection-file", str(missing), "--wait", "0.3", "--", "--log-level=40")
    assert result.returncode == 1
    assert "engine not started" in result.stderr and str(missing) in result.stderr


def test_a_wait_that_is_not_positive_is_refused(tmp_path):
    result = _entry("--connection-file", str(tmp_path / "x.json"), "--wait", "0")
    assert result.returncode == 2
    assert "--wait must be a positive number of seconds, got 0" in result.stderr
