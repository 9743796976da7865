"""Before ssh engines start: every host answers, and its Python has the kernel's versions.

ipyparallel's ssh launcher starts engines one host after another and reports an
unreachable host as "Unable to get remote shell information" without naming it, or a
Python without the package as a failed ``IPython profile create``. :func:`check_hosts`
asks every host of ``SSHEngineSetLauncher.engines`` at once, with one ssh each (bounded
by ``ConnectTimeout`` and ``BatchMode``, so a password prompt fails instead of waiting),
for the versions its ``remote_python`` has, and refuses, naming each host and both
versions, before any engine starts.

Only the settings given in the pool's ``config`` are read (ipyparallel also reads
profile configuration files: hosts named only there are not checked).
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fsdp_interactive.pool.common import _hosts

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
_CHECK_TIMEOUT_S = 60.0
_VERSIONS = (
    "import importlib.metadata as m, json, platform\n"
    "def v(name):\n"
    "    try:\n"
    "        return m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        return None\n"
    "print(json.dumps({'python': platform.python_version(), "
    + ", ".join(f"{name!r}: v({name!r})" for name in _hosts.CHECKED_DISTRIBUTIONS)
    + "}))"
)


def _setting(section: Any, name: str, default: Any) -> Any:
    try:
        return section.get(name, default)
    except (AttributeError, TypeError):
        return default


def host_commands(config: Any) -> dict[str, list[str]]:
    """``host key -> the ssh command that prints that host's versions``, from
    ``config["SSHEngineSetLauncher"]`` (empty when it names no hosts)."""
    section = _setting(config or {}, "SSHEngineSetLauncher", {})
    engines = _setting(section, "engines", {}) or {}
    if not isinstance(engines, Mapping):
        return {}
    commands = {}
    for key, value in engines.items():
        overrides = value if isinstance(value, Mapping) else {}
        python = str(
            _setting(overrides, "remote_python", _setting(section, "remote_python", "python3"))
        )
        ssh_cmd = list(_setting(overrides, "ssh_cmd", _setting(section, "ssh_cmd", ["ssh"])))
        ssh_args = [
            arg
            for arg in _setting(overrides, "ssh_args", _setting(section, "ssh_args", []))
            if arg not in ("-tt", "-t")  # no terminal: the answer is read as it is
        ]
        location, port = str(key), None
        host_part = location.split("@", 1)[-1]
        if ":" in host_part:
            name, port = host_part.rsplit(":", 1)
            location = location[: len(location) - len(host_part)] + name
        commands[str(key)] = [
            *ssh_cmd,
            *ssh_args,
            *(["-p", port] if port else []),
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            location,
            "--",
            f"{shlex.quote(python)} -c {shlex.quote(_VERSIONS)}",
        ]
    return commands


def _ask(command: list[str]) -> tuple[dict[str, Any] | None, str]:
    """The versions a host printed, or ``None`` and what went wrong."""
    try:
        out = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"no answer within {_CHECK_TIMEOUT_S:g}s"
    except OSError as exc:
        return None, str(exc)
    lines = out.stdout.strip().splitlines()
    if out.returncode == 0 and lines:
        try:
            return json.loads(lines[-1]), ""
        except ValueError:
            pass
    said = (out.stderr.strip() or out.stdout.strip()).splitlines()[-3:]
    return None, f"exit status {out.returncode}: " + " / ".join(said)


def check_hosts(config: Any, only: Collection[str] | None = None) -> None:
    """Refuse (``RuntimeError`` with one line per host) hosts that do not answer over
    ssh or whose ``remote_python`` runs other versions than this kernel.

    ``only``: the host keys to ask (default: every host of the config)."""
    commands = host_commands(config)
    if only is not None:
        commands = {key: command for key, command in commands.items() if key in only}
    if not commands:
        return
    with ThreadPoolExecutor(max_workers=min(16, len(commands))) as pool:
        answers = dict(zip(commands, pool.map(_ask, commands.values()), strict=True))
    here = _hosts.versions()
    problems = []
    for host, (there, error) in answers.items():
        if there is None:
            problems.append(f"{host}: cannot run its remote_python over ssh ({error})")
            continue
        mismatches = _hosts.version_mismatches(here, there)
        if mismatches:
            problems.append(_hosts.describe_mismatches(host, mismatches))
    if problems:
        raise RuntimeError(
            "no engine was started; the ssh hosts must answer and run this kernel's "
            "versions:\n  " + "\n  ".join(problems)
        )
    log.debug("ssh hosts %s answered with matching versions", sorted(answers))
