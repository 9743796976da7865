"""The parent of an engine on another host: it runs the engine and says how it ended.

``python -m fsdp_interactive._engine_parent -- python -m ipyparallel.engine ...``

ipyparallel's remote launchers cannot tell how an engine ended: the ssh launcher's
engine is a ``nohup`` orphan whose status nobody collects (its launcher reports -1 for
any end), and a SLURM job or an ``mpiexec`` reports one status for all ranks. The pool
therefore starts such remote engines under this small parent
(:mod:`fsdp_interactive.pool.processes._launched` wraps the engine command of the SLURM,
MPI and other launchers, and of ipyparallel's ssh launcher when a config sets its engine
command; the pool's own ssh engines are forked on their host by an engine forker, which
reports how each ended). It:

* runs the engine command as its child, with the same standard streams, so the
  engine's output goes where the launcher sends it;
* passes on SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 (launchers signal the
  pid they started, which is this process), also one that comes while the engine is
  still starting: the signals wait blocked until the parent takes them with
  ``sigtimedwait``, so none is lost, none ends the parent on its own, and none waits for
  a thread that happens to be in a system call;
* when the engine ends, writes one line to stderr, :data:`MARKER` followed by the
  engine's pid, its host and the exit status (negative: the signal's number), which
  the kernel reads from the engine's output (:func:`parse_exit`);
* exits the way the engine did (the same signal, or the same status), so that
  ``srun``/``mpiexec`` report the engine's own end;
* makes the engine get SIGKILL should this parent die (``PR_SET_PDEATHSIG``), so
  that no engine outlives it.

It imports only the standard library, and sits at the package root so that ``-m`` loads
nothing else of the package: it starts in a fraction of a second. Not done: Windows.
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
_WATCHED = {*_FORWARDED, signal.SIGCHLD}
_POLL_S = 1.0
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


def _prepare_child() -> None:
    """In the child, before exec: take the signals the parent blocked, and get SIGKILL when
    the parent ends (Linux; elsewhere only the former)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WATCHED)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _wait_passing_signals_on(child: subprocess.Popen[bytes]) -> int:
    """Wait for ``child`` to end, sending it each forwarded signal this process gets; its
    exit status (negative: the signal that ended it)."""
    while True:
        code = child.poll()
        if code is not None:
            return code
        # SIGCHLD wakes the wait when the engine ends; the timeout only bounds how long
        # an end could go unnoticed should SIGCHLD have been taken by someone else.
        info = signal.sigtimedwait(_WATCHED, _POLL_S)
        if info is not None and info.si_signo != signal.SIGCHLD:
            # The child is not reaped before the next poll: its pid is still its own.
            child.send_signal(info.si_signo)


def _end_like(code: int) -> int:
    """End this process the way the engine ended: by the same signal, else the status."""
    if code < 0:
        sig = -code
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m fsdp_interactive._engine_parent -- COMMAND...", file=sys.stderr)
        return 2
    # Blocked before the engine starts: a signal that comes meanwhile waits for the loop.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    try:
        child = subprocess.Popen(args, preexec_fn=_prepare_child)
    except OSError as error:
        print(f"fsdp_interactive._engine_parent: cannot run {args[0]!r}: {error}", file=sys.stderr)
        return 127
    code = _wait_passing_signals_on(child)
    print(exit_line(child.pid, socket.gethostname(), code), file=sys.stderr, flush=True)
    return _end_like(code)


if __name__ == "__main__":
    sys.exit(main())
