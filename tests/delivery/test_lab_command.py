"""``fsdp-interactive lab``: options, errors, and where it finds the notebooks.

Starting a real JupyterLab through this command is covered by test_docker_entrypoint.py
(the images start it that way). Here: the parser, the error exits, the JupyterLab command
line, a checkout's notebooks, and the notebooks of a real wheel installed into a prefix.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_interactive.cli import build_parser, lab, main

REPO = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["lab", *argv])


def test_lab_is_a_registered_subcommand_with_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["lab", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for option in ("--port", "--ip", "--no-browser", "--notebook-dir"):
        assert option in out


@pytest.mark.parametrize("port", ["0", "65536", "http", "-3"])
def test_bad_port_exits_2_with_a_usage_line(capsys: pytest.CaptureFixture[str], port: str) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["lab", f"--port={port}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fsdp-interactive lab")
    assert "argument --port" in err and repr(port) in err


def test_unknown_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["lab", "--ServerApp.base_url=/x/"])
    assert stop.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_missing_notebook_dir_exits_2_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    assert main(["lab", "--notebook-dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "--notebook-dir" in err and str(missing) in err


def test_without_jupyterlab_exits_2_saying_what_to_install() -> None:
    # A real process in which jupyterlab cannot be imported (None in sys.modules).
    code = (
        "import sys; sys.modules['jupyterlab'] = None\n"
        "from fsdp_interactive.cli import main\n"
        "raise SystemExit(main(['lab', '--no-browser']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 2
    assert 'pip install "fsdp-interactive[lab]"' in result.stderr


def test_options_map_onto_the_jupyterlab_command_line(tmp_path: Path) -> None:
    args = _parse("--port", "8899", "--ip", "0.0.0.0", "--no-browser", "--", "--debug")
    assert lab.jupyterlab_command(args, tmp_path) == [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={tmp_path}",
        "--ip=0.0.0.0",
        "--port=8899",
        "--ServerApp.port_retries=0",
        "--no-browser",
        "--debug",
    ]
    # Without options, Jupyter's own defaults apply (port retries included).
    assert lab.jupyterlab_command(_parse(), tmp_path) == [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={tmp_path}",
    ]


def test_notebook_dir_is_opened_as_given(tmp_path: Path) -> None:
    assert lab.resolve_notebook_dir(tmp_path) == tmp_path.resolve()
    assert list(tmp_path.iterdir()) == [], "nothing is copied into a folder of the user's"


def test_a_checkout_opens_its_own_notebooks_folder(tmp_path: Path) -> None:
    assert lab.SOURCE_ROOT == REPO, "run from this checkout, the package's root is the repo"
    assert lab.checkout_notebooks(tmp_path) is None
    (tmp_path / "notebooks").mkdir()
    assert lab.checkout_notebooks(tmp_path) is None, "a notebooks/ folder alone is no checkout"
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    assert lab.checkout_notebooks(tmp_path) == tmp_path / "notebooks"


def _notebook(title: str) -> str:
    cell = {"cell_type": "markdown", "id": "t", "metadata": {}, "source": [title]}
    return json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


@pytest.fixture(scope="module")
def installed_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real wheel of this project, with two notebooks, installed into a fresh prefix."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(
        REPO / "fsdp_interactive",
        source / "fsdp_interactive",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (source / "notebooks").mkdir()
    for name in ("01_first.ipynb", "02_second.ipynb"):
        (source / "notebooks" / name).write_text(_notebook(name))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", root / "dist", source],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (root / "dist").glob("*.whl")
    prefix = root / "prefix"
    subprocess.run(
        # --ignore-installed: without it pip would first uninstall the running environment's
        # own fsdp-interactive, even though it installs into another prefix.
        [
            *pip,
            "install",
            "--no-deps",
            "--no-compile",
            "--ignore-installed",
            "--prefix",
            prefix,
            wheel,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return prefix


def _run_installed(prefix: Path, cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    (site,) = prefix.glob("lib/python*/site-packages")
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_wheel_installs_the_notebooks_as_data_files(installed_prefix: Path) -> None:
    shipped = installed_prefix / lab.BUNDLED_NOTEBOOKS
    assert sorted(p.name for p in shipped.iterdir()) == ["01_first.ipynb", "02_second.ipynb"]


def test_an_installed_package_copies_the_notebooks_into_a_working_folder(
    installed_prefix: Path, tmp_path: Path
) -> None:
    code = (
        "from fsdp_interactive.cli import lab\n"
        "assert lab.checkout_notebooks() is None, lab.SOURCE_ROOT\n"
        "print(lab.resolve_notebook_dir(None))\n"
    )
    first = _run_installed(installed_prefix, tmp_path, code)
    assert first.returncode == 0, first.stderr
    working = tmp_path / "fsdp-interactive-notebooks"
    assert first.stdout.strip() == str(working)
    assert "2 tutorial notebook(s) copied" in first.stderr
    assert (working / "01_first.ipynb").read_text() == _notebook("01_first.ipynb")

    # A second start keeps the user's edits and restores only what is missing.
    (working / "01_first.ipynb").write_text(_notebook("edited"))
    (working / "02_second.ipynb").unlink()
    second = _run_installed(installed_prefix, tmp_path, code)
    assert second.returncode == 0, second.stderr
    assert "1 tutorial notebook(s) copied" in second.stderr and "1 already there" in second.stderr
    assert (working / "01_first.ipynb").read_text() == _notebook("edited")
    assert (working / "02_second.ipynb").read_text() == _notebook("02_second.ipynb")
