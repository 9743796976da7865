"""ssh to the hosts of an attached job: reading its records there, and tunnels to its ranks.

A job's ranks listen on Unix sockets in a private folder of their host
(:mod:`fsdp_interactive._attach_records`). A notebook on another host (a login node)
reaches them through ``ssh``, as the same user, with nothing listening on a network port:

* :func:`remote_records` runs ``python -m fsdp_interactive._attach_records JOB`` on the
  host and reads the JSON it prints (the keys travel inside the ssh connection, never on
  a command line: the command names only the job);
* :class:`SshTunnel` is one ``ssh -N`` per host that forwards a local Unix socket (in a
  private folder of this kernel's host) to each rank's socket there
  (``-L local.sock:remote.sock``, OpenSSH's stream-local forwarding). The ssh process
  gets SIGKILL when the kernel dies (``PR_SET_PDEATHSIG``), so no tunnel outlives it.

``ssh_args`` are passed to every ssh command as given (``["-F", config]``, ``["-p",
"2222"]``); ``BatchMode`` is set, so a host that would ask for a password fails at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
_PR_SET_PDEATHSIG = 1


def ssh_command(host: str, ssh_args: Sequence[str], *extra: str) -> list[str]:
    return [
        "ssh",
        *ssh_args,
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={CONNECT_TIMEOUT_S}",
        *extra,
        host,
    ]


def remote_records(
    host: str,
    job: str | None,
    *,
    ssh_args: Sequence[str] = (),
    python: str,
    attach_dir: str | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """What ``python -m fsdp_interactive._attach_records`` prints on ``host``: ``{"host",
    "attach_dir", "jobs": {name: [record dicts]}}``; ``OSError`` naming the host when ssh
    or the program fails."""
    remote = [python, "-m", "fsdp_interactive._attach_records"]
    remote += [job] if job else []
    remote += ["--attach-dir", attach_dir] if attach_dir else []
    command = [*ssh_command(host, ssh_args), shlex.join(remote)]
    log.debug("reading attach records on %s: %s", host, shlex.join(command))
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise OSError(f"ssh {host} failed: {error}") from None
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise OSError(
            f"ssh {host} could not read the job's records (exit status {done.returncode}): "
            f"{why[-1] if why else 'no output'}"
        )
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise OSError(
            f"{host} answered something other than attach records: {done.stdout[-200:]!r}"
        ) from None
    if "error" in answer:
        raise OSError(f"{host}: {answer['error']}")
    return answer


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class SshTunnel:
    """One ``ssh -N`` forwarding local Unix sockets to sockets on ``host``
    (``forwards``: ``[(local path, remote path)]``)."""

    def __init__(self, host: str, ssh_args: Sequence[str], forwards: Sequence[tuple[str, str]]):
        self.host = host
        self.forwards = list(forwards)
        extra: list[str] = [
            "-N",
            "-o",
            "ExitOnForwardFailure=yes",
            "-o",
            "StreamLocalBindUnlink=yes",
            "-o",
            "ServerAliveInterval=5",
        ]
        for local, remote in self.forwards:
            extra += ["-L", f"{local}:{remote}"]
        self.command = ssh_command(host, ssh_args, *extra)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start ssh and wait until every local socket exists; ``OSError`` with ssh's
        message when it ends first or takes longer than ``timeout``."""
        log.debug("tunnel to %s: %s", self.host, shlex.join(self.command))
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(local) for local, _ in self.forwards):
            if self.process.poll() is not None:
                error = (
                    self.process.stderr.read().decode(errors="replace")
                    if self.process.stderr
                    else ""
                )
                self.process = None
                raise OSError(
                    f"the ssh tunnel to {self.host} ended: {error.strip() or 'no message'}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise OSError(f"the ssh tunnel to {self.host} was not up within {timeout:.0f} s")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """End ssh (SIGTERM, then SIGKILL) and remove the local sockets."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        if process is not None and process.stderr is not None:
            process.stderr.close()
        for local, _ in self.forwards:
            with contextlib.suppress(OSError):
                os.unlink(local)
