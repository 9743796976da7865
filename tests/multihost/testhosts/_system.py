"""Low-level steps of the simulated hosts: network namespaces, sysctls, keys, processes
found and ended by namespace, and waiting for a condition or a port."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from fsdp_interactive.pool.processes._pids import is_running

DEFAULT_STATE = "/tmp/fsdpi-testhosts"
LOCK = "/run/lock/fsdpi-testhosts.lock"
RUNTIME_ROOT = "/run/fsdpi-testhosts"
NETNS_PREFIX = "fsdpi"
HEAD_HOST = 254
TERM_GRACE_S = 5.0


class HostSetError(RuntimeError):
    """The host set could not be brought up (the message says which step and why)."""


@contextlib.contextmanager
def environ_set(env: dict[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` for the block; each key's earlier value (or absence) after."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise HostSetError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def netns_sysctl(netns: str, setting: str) -> None:
    key, value = setting.split("=")
    quiet(["nsenter", f"--net=/run/netns/{netns}", "sysctl", "-q", "-w", f"{key}={value}"])


def write_sysctl(path: str, value: str) -> None:
    with open(f"/proc/sys/{path}", "w") as f:
        f.write(value)


def keygen(path: Path, comment: str) -> None:
    """A fresh passphrase-less ed25519 key pair at ``path`` (replacing an old one)."""
    for old in (path, path.with_name(path.name + ".pub")):
        old.unlink(missing_ok=True)
    quiet(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


def quiet(argv: Sequence[str]) -> None:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise HostSetError(
            f"`{shlex.join(argv)}` failed: {(result.stderr or result.stdout).strip()}"
        )


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def slot_of(netns: str) -> int | None:
    if not netns.startswith(NETNS_PREFIX):
        return None
    digits = netns[len(NETNS_PREFIX) :].split("-")[0]
    return int(digits) if digits.isdigit() else None


def alive(record: Mapping[str, Any]) -> bool:
    """Whether the recorded process (its pid and start time) still runs."""
    return is_running(record["pid"], record.get("start_time"))


def processes_in_netns(inodes: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino in inodes:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def safe(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.cmdline()
            alive.append(proc)
    return alive


def end(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, each of ``procs`` (already matched)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, left = psutil.wait_procs(procs, timeout=grace)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=grace)


def wait_for(
    condition: Any,
    timeout: float,
    what: str,
    log: Path | None = None,
    poll: float = 0.1,
    process: subprocess.Popen | None = None,
) -> None:
    """Wait for ``condition``; raise with ``log``'s tail on timeout or when ``process`` exits."""
    end = time.monotonic() + timeout
    while not condition():
        exited = process is not None and process.poll() is not None
        if exited or time.monotonic() > end:
            tail = ""
            if log is not None and log.exists():
                tail = (
                    "; last lines of "
                    + str(log)
                    + ":\n"
                    + "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
                )
            reason = (
                f"it exited ({process.returncode})" if exited else f"timed out after {timeout:g}s"
            )
            raise HostSetError(f"{reason} waiting for {what}{tail}")
        time.sleep(poll)


def wait_for_port(address: str, port: int, timeout: float, what: str) -> None:
    def listening() -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((address, port)) == 0

    wait_for(listening, timeout, what)
