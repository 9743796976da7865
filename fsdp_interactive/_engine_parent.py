"""The parent of an engine on another host: it runs the engine and says how it ended.

``python -m fsdp_interactive.pool._engine_parent -- python -m ipyparallel.engine ...``

ipyparallel's remote launchers cannot tell how an engine ended: the ssh launcher's
engine is a ``nohup`` orphan whose status nobody collects (its launcher reports -1 for
any end), and a SLURM job or an ``mpiexec`` reports one status for all ranks. The pool
therefore starts remote engines under this small parent (:mod:`._processes` wraps the
engine command of the ssh, SLURM, MPI and other non-local launchers). It:

* runs the engine command as its child, with the same standard streams, so the
  engine's output goes where the launcher sends it;
* passes on SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 (launchers signal the
  pid they started, which is this process);
* when the engine ends, writes one line to stderr, :data:`MARKER` followed by the
  engine's pid, its host and the exit status (negative: the signal's number), which
  the kernel reads from the engine's output (:func:`parse_exit`);
* exits the way the engine did (the same signal, or the same status), so that
  ``srun``/``mpiexec`` report the engine's own end;
* makes the engine get SIGKILL should this parent die (``PR_SET_PDEATHSIG``), so
  that no engine outlives it.

It imports only the standard library: it starts in a fraction of a second.
Not done: Windows.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys

MARKER = "fsdp-interactive engine ended:"
_FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_PR_SET_PDEATHSIG = 1
_LINE = re.compile(re.escape(MARKER) + r" pid (\d+) on (\S+) exit (-?\d+)")


def exit_line(pid: int, host: str, code: int) -> str:
    """The line written when engine ``pid`` on ``host`` ended with ``code``."""
    return f"{MARKER} pid {pid} on {host} exit {code}"


def parse_exit(output: str, pid: int | None = None, host: str | None = None) -> int | None:
    """The exit status the parent reported in ``output`` (for ``pid`` on ``host`` when
    given; the last report wins); ``None`` when there is none."""
    found = None
    for match in _LINE.finditer(output):
        if pid is not None and int(match.group(1)) != pid:
            continue
        if host is not None and match.group(2) != host:
            continue
        found = int(match.group(3))
    return found


def wrap(command: list[str]) -> list[str]:
    """``command`` run under this parent, started by the same Python; an ``ipyparallel
    .engine`` command only (any other is returned as it is)."""
    if len(command) >= 3 and command[1:3] == ["-m", "ipyparallel.engine"]:
        return [command[0], "-m", __name__, "--", *command]
    return list(command)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent ends (Linux; else nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(
            "usage: python -m fsdp_interactive.pool._engine_parent -- COMMAND...", file=sys.stderr
        )
        return 2
    child = subprocess.Popen(args, preexec_fn=_die_with_parent)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            child.send_signal(signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    code = child.wait()
    print(exit_line(child.pid, socket.gethostname(), code), file=sys.stderr, flush=True)
    if code < 0:
        sig = -code
        for forwarded in _FORWARDED:
            signal.signal(forwarded, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
