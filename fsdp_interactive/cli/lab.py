"""``fsdp-interactive lab``: JupyterLab on the tutorial notebooks.

Which folder JupyterLab opens:

* ``--notebook-dir DIR``: DIR, as it is (it must exist; nothing is copied into it).
* Run from a source checkout (the package sits next to ``pyproject.toml`` and
  ``notebooks/``): the checkout's ``notebooks/`` folder, in place.
* Installed from a wheel: the wheel ships the tutorials as data files under
  ``<prefix>/share/fsdp-interactive/notebooks``. They are copied into
  ``./fsdp-interactive-notebooks`` (created if needed; files already there are never
  overwritten) and that folder is opened, so that running and editing them never writes
  into the installation.

JupyterLab then replaces this process (``exec`` on POSIX), so signals and the exit
status are JupyterLab's own. The token follows Jupyter's rules: ``JUPYTER_TOKEN`` if set,
otherwise one generated and printed by the server. With an explicit ``--port`` the server
fails instead of silently moving to the next free port.

Not done here: installing JupyterLab (``pip install "fsdp-interactive[lab]"``), any
kernel or cluster set-up (the notebooks start their own pools).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

from fsdp_interactive.cli._arguments import tcp_port

DISTRIBUTION = "fsdp-interactive"
# Where the wheel installs the tutorials, relative to the installation prefix.
BUNDLED_NOTEBOOKS = PurePosixPath("share/fsdp-interactive/notebooks")
# Working copy made for an installed package, relative to the current directory.
WORKING_COPY = Path("fsdp-interactive-notebooks")
INSTALL_HINT = 'pip install "fsdp-interactive[lab]"'
# The folder holding the package: a checkout's root when it runs from source.
SOURCE_ROOT = Path(__file__).resolve().parents[2]


class LabError(Exception):
    """A condition that stops ``lab`` before JupyterLab starts (exit status 2)."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``lab`` and its options."""
    parser = subparsers.add_parser(
        "lab",
        help="start JupyterLab on the tutorial notebooks",
        description=(
            "Start JupyterLab on the tutorial notebooks: the checkout's notebooks/ folder, "
            "or a working copy of the installed ones in ./fsdp-interactive-notebooks. "
            "Arguments after '--' go to JupyterLab unchanged."
        ),
    )
    parser.add_argument(
        "--port", type=tcp_port, help="port to listen on (default: Jupyter's, 8888)"
    )
    parser.add_argument("--ip", help="address to listen on (default: Jupyter's, localhost)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a web browser")
    parser.add_argument(
        "--notebook-dir", type=Path, help="open this existing folder instead of the tutorials"
    )
    parser.add_argument(
        "jupyter_args", nargs="*", metavar="-- JUPYTER_ARGS", help="passed to JupyterLab"
    )
    return parser


def checkout_notebooks(root: Path = SOURCE_ROOT) -> Path | None:
    """The ``notebooks/`` folder of the source checkout at ``root``, if it is one.

    ``root`` defaults to the folder holding this package: a checkout when the package runs
    from source (editable installs included), ``site-packages`` when installed.
    """
    folder = root / "notebooks"
    if (root / "pyproject.toml").is_file() and folder.is_dir():
        return folder
    return None


def bundled_notebooks() -> list[Path]:
    """The tutorial notebooks installed with the distribution (empty if none are)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = f"/{BUNDLED_NOTEBOOKS}/"
    found = [
        Path(dist.locate_file(entry)).resolve()
        for entry in dist.files or []
        if marker in "/" + entry.as_posix() and entry.suffix == ".ipynb"
    ]
    return sorted(path for path in found if path.is_file())


def copy_missing(sources: list[Path], target: Path) -> list[Path]:
    """Copy each source file into ``target`` unless a file of that name is there.

    Returns the files written; existing files are left untouched.
    """
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sources:
        destination = target / source.name
        if not destination.exists():
            shutil.copy2(source, destination)
            written.append(destination)
    return written


def resolve_notebook_dir(requested: Path | None) -> Path:
    """The folder JupyterLab opens (see the module docstring); raises LabError."""
    if requested is not None:
        if not requested.is_dir():
            raise LabError(
                f"--notebook-dir: expected an existing directory, got {str(requested)!r}"
            )
        return requested.resolve()
    checkout = checkout_notebooks()
    if checkout is not None:
        return checkout
    bundled = bundled_notebooks()
    if not bundled:
        raise LabError(
            f"no tutorial notebooks found in the {DISTRIBUTION} installation; "
            "pass --notebook-dir to open a folder of your own"
        )
    target = WORKING_COPY.resolve()
    written = copy_missing(bundled, target)
    print(
        f"fsdp-interactive lab: {len(written)} tutorial notebook(s) copied to {target} "
        f"({len(bundled) - len(written)} already there, kept)",
        file=sys.stderr,
    )
    return target


def jupyterlab_command(args: argparse.Namespace, notebook_dir: Path) -> list[str]:
    """The JupyterLab command line for the parsed ``lab`` options."""
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={notebook_dir}"]
    if args.ip is not None:
        command.append(f"--ip={args.ip}")
    if args.port is not None:
        command += [f"--port={args.port}", "--ServerApp.port_retries=0"]
    if args.no_browser:
        command.append("--no-browser")
    return command + list(args.jupyter_args)


def run(args: argparse.Namespace) -> int:
    """Start JupyterLab; returns 2 (with a message) if it cannot be started."""
    if importlib.util.find_spec("jupyterlab") is None:
        print(
            f"fsdp-interactive lab: JupyterLab is not installed; install it with: {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    try:
        notebook_dir = resolve_notebook_dir(args.notebook_dir)
    except LabError as error:
        print(f"fsdp-interactive lab: {error}", file=sys.stderr)
        return 2
    command = jupyterlab_command(args, notebook_dir)
    print(f"fsdp-interactive lab: starting JupyterLab in {notebook_dir}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execv(command[0], command)
    return subprocess.call(command)
