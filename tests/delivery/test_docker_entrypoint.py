"""The images' entrypoint and health check, run for real outside a container.

The entrypoint is the real script under a real bash. Its argument and environment
handling is checked with a recording stand-in for ``fsdp-interactive`` first on PATH;
then, once per module, the whole chain the image runs — entrypoint, the real
``fsdp-interactive lab``, a real JupyterLab server — is started on a free loopback port
and probed over HTTP, the health check included.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO / "docker" / "healthcheck.py"
VENV_BIN = Path(sys.executable).parent
# The images run JupyterLab unprivileged; CI runs as root, where Jupyter wants consent.
ROOT_CONSENT = ["--allow-root"] if os.geteuid() == 0 else []

RECORDER = """#!/usr/bin/env bash
# Stand-in for fsdp-interactive: records its arguments and the token it was given.
{ printf '%s\\n' "$@"; } > "$RECORD_DIR/argv"
printf '%s' "${JUPYTER_TOKEN-<unset>}" > "$RECORD_DIR/token"
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / "notebooks").mkdir(parents=True)
    return home


@pytest.fixture
def recorder(tmp_path: Path) -> Path:
    """A folder holding a recording ``fsdp-interactive``; its records land beside it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "fsdp-interactive"
    fake.write_text(RECORDER)
    fake.chmod(0o755)
    return bin_dir


def _run_entrypoint(recorder: Path, home: Path, *args: str, **env: str):
    environment = {
        "PATH": f"{recorder}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "RECORD_DIR": str(recorder),
        **env,
    }
    return subprocess.run(
        ["bash", ENTRYPOINT, *args], env=environment, capture_output=True, text=True, timeout=30
    )


def _recorded(recorder: Path) -> tuple[list[str], str]:
    argv = (recorder / "argv").read_text().splitlines()
    return argv, (recorder / "token").read_text()


def test_defaults_start_lab_on_all_addresses_with_a_generated_token(
    recorder: Path, home: Path
) -> None:
    result = _run_entrypoint(recorder, home)
    assert result.returncode == 0, result.stderr
    argv, token = _recorded(recorder)
    assert argv == [
        "lab",
        "--ip",
        "0.0.0.0",
        "--port",
        "8888",
        "--no-browser",
        "--notebook-dir",
        str(home / "notebooks"),
    ]
    assert re.fullmatch(r"[0-9a-f]{48}", token), token
    # The generated token is printed, with a URL that carries it.
    assert f"token (generated): {token}" in result.stdout
    assert f"http://127.0.0.1:8888/lab?token={token}" in result.stdout


def test_each_start_generates_a_new_token(recorder: Path, home: Path) -> None:
    tokens = set()
    for _ in range(2):
        assert _run_entrypoint(recorder, home, JUPYTER_TOKEN="").returncode == 0
        tokens.add(_recorded(recorder)[1])
    assert len(tokens) == 2


def test_port_address_token_and_folder_come_from_the_environment(
    recorder: Path, home: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    result = _run_entrypoint(
        recorder,
        home,
        JUPYTER_PORT="9876",
        JUPYTER_IP="127.0.0.1",
        JUPYTER_TOKEN="s3cret-token",
        FSDP_INTERACTIVE_NOTEBOOK_DIR=str(folder),
    )
    assert result.returncode == 0, result.stderr
    argv, token = _recorded(recorder)
    assert argv == [
        "lab",
        "--ip",
        "127.0.0.1",
        "--port",
        "9876",
        "--no-browser",
        "--notebook-dir",
        str(folder),
    ]
    assert token == "s3cret-token"
    assert "s3cret-token" not in result.stdout + result.stderr, "a chosen token is not printed"


def test_option_arguments_are_passed_on_to_jupyterlab(recorder: Path, home: Path) -> None:
    result = _run_entrypoint(recorder, home, "--ServerApp.base_url=/lab/", "--debug")
    assert result.returncode == 0, result.stderr
    argv, _ = _recorded(recorder)
    assert argv[-3:] == ["--", "--ServerApp.base_url=/lab/", "--debug"]


def test_a_command_runs_instead_of_the_lab(recorder: Path, home: Path) -> None:
    result = _run_entrypoint(recorder, home, "echo", "hello from the image")
    assert result.returncode == 0
    assert result.stdout == "hello from the image\n"
    assert not (recorder / "argv").exists()


@pytest.mark.parametrize("port", ["abc", "0", "65536", "80 80", "-1"])
def test_bad_port_exits_2_naming_the_variable(recorder: Path, home: Path, port: str) -> None:
    result = _run_entrypoint(recorder, home, JUPYTER_PORT=port)
    assert result.returncode == 2
    assert "JUPYTER_PORT" in result.stderr and f"'{port}'" in result.stderr
    assert not (recorder / "argv").exists()


def test_empty_port_means_the_default(recorder: Path, home: Path) -> None:
    result = _run_entrypoint(recorder, home, JUPYTER_PORT="")
    assert result.returncode == 0, result.stderr
    argv, _ = _recorded(recorder)
    assert argv[argv.index("--port") + 1] == "8888"


def test_missing_notebook_folder_exits_2_naming_the_variable(
    recorder: Path, home: Path, tmp_path: Path
) -> None:
    result = _run_entrypoint(
        recorder, home, FSDP_INTERACTIVE_NOTEBOOK_DIR=str(tmp_path / "nowhere")
    )
    assert result.returncode == 2
    assert "FSDP_INTERACTIVE_NOTEBOOK_DIR" in result.stderr
    assert not (recorder / "argv").exists()


# --- the real chain: entrypoint -> fsdp-interactive lab -> JupyterLab ---------------------


class LabServer:
    """A JupyterLab started through the entrypoint, as the image starts it."""

    def __init__(self, root: Path) -> None:
        self.port = _free_port()
        self.token = "entrypoint-test-token"
        self.notebooks = root / "home" / "notebooks"
        self.notebooks.mkdir(parents=True)
        (self.notebooks / "marker.ipynb").write_text(
            json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
        )
        self.env = {
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(root / "home"),
            "JUPYTER_PORT": str(self.port),
            "JUPYTER_IP": "127.0.0.1",
            "JUPYTER_TOKEN": self.token,
            "JUPYTER_CONFIG_DIR": str(root / "config"),
            "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
        }
        self.log = (root / "lab.log").open("w")
        self.process = subprocess.Popen(
            ["bash", ENTRYPOINT, *ROOT_CONSENT],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, token: str | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}")
        if token is not None:
            request.add_header("Authorization", f"token {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            return error.code, {}

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}")
            try:
                if self.get("/api/status", self.token)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"JupyterLab did not answer on port {self.port} in {timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    root = tmp_path_factory.mktemp("lab")
    server = LabServer(root)
    try:
        try:
            server.wait_ready()
        except RuntimeError as error:
            pytest.fail(f"{error}\n{(root / 'lab.log').read_text()}")
        yield server
    finally:
        server.stop()


def test_lab_requires_the_token(lab: LabServer) -> None:
    assert lab.get("/api/contents", lab.token)[0] == 200
    assert lab.get("/api/contents")[0] == 403
    assert lab.get("/api/contents", "wrong-token")[0] == 403


def test_lab_opens_the_notebook_folder(lab: LabServer) -> None:
    status, listing = lab.get("/api/contents", lab.token)
    assert status == 200
    assert [item["name"] for item in listing["content"]] == ["marker.ipynb"]


def test_lab_serves_jupyterlab_itself(lab: LabServer) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{lab.port}/lab", headers={"Authorization": f"token {lab.token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        assert "JupyterLab" in response.read().decode()


def test_healthcheck_reports_the_running_lab_healthy(lab: LabServer) -> None:
    result = subprocess.run(
        [sys.executable, HEALTHCHECK], env=lab.env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert f"127.0.0.1:{lab.port}" in result.stdout


def test_healthcheck_reports_a_silent_port_unhealthy(lab: LabServer) -> None:
    env = {**lab.env, "JUPYTER_PORT": str(_free_port())}
    result = subprocess.run(
        [sys.executable, HEALTHCHECK], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert "unhealthy" in result.stderr


def test_a_taken_port_fails_instead_of_moving(lab: LabServer, tmp_path: Path) -> None:
    """With an explicit port, a second server on it exits instead of taking the next one."""
    result = subprocess.run(
        [
            VENV_BIN / "fsdp-interactive",
            "lab",
            "--ip",
            "127.0.0.1",
            "--port",
            str(lab.port),
            "--no-browser",
            "--notebook-dir",
            str(tmp_path),
            "--",
            *ROOT_CONSENT,
        ],
        env={**lab.env, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert str(lab.port) in result.stderr and "in use" in result.stderr
