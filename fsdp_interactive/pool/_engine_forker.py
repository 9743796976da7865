"""A process that imports torch and ipyparallel's engine once, then forks engine processes.

``python -m fsdp_interactive.pool._engine_forker`` speaks JSON lines: it reads requests on
stdin and writes replies and events on stdout. It exists because importing torch takes
seconds of CPU in every new process; engines forked from a process that has imported it
start without that cost (and share its memory pages until they write to them).

Protocol (one JSON object per line):

* request ``{"token": T, "argv": [...], "env": {...}, "cwd": DIR, "output": FILE}``: fork a
  child that runs ``argv`` as ``python -m MODULE ARGS`` would (``argv`` must have that
  shape: ``[python, "-m", MODULE, *ARGS]``), in its own session, with stdin from
  ``/dev/null``, stdout and stderr appended to ``FILE``, exactly the environment ``env``
  and working directory ``DIR``. With ``"nanny": true`` the child is an ipyparallel
  engine: the forker also forks the engine's nanny, ready-made, in its own session with
  its output in ``FILE`` too, and the engine finds its ends of the pipes to it in
  ``$FSDPI_NANNY_FDS`` (:mod:`._forked_nanny`);
* reply ``{"token": T, "pid": P}`` (and ``"nanny_pid"`` with a nanny), or
  ``{"token": T, "error": "..."}`` when the request is malformed or the fork failed;
* event ``{"exited": P, "exit_code": C}`` when child ``P`` ends (``C`` negative: killed by
  signal ``-C``), as ``subprocess`` reports it. A nanny's end is not reported: it ends
  after its engine, whose end is.

The forker writes nothing else on stdout; its own diagnostics go to stderr. It exits
when its stdin closes (its owner stopped it or died); children still running then are
not touched (they run in their own sessions and are ended by whoever started them).

Fork safety: the forker never starts a thread itself and never runs a torch operation
(so no intra-op thread pool exists), never touches CUDA, and opens no ZeroMQ context;
the one thread that importing numpy may start is OpenBLAS's, which shuts itself down
around ``fork`` (its ``pthread_atfork`` handlers). Children re-seed numpy's global random
state, as independent processes would have different ones (Python's ``random`` is
re-seeded by the interpreter itself).
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from fsdp_interactive.pool import _forked_nanny

#: Modules imported once here so that no forked engine pays for them: torch, the engine,
#: its nanny, and the kernel's debugger support it imports while it starts (debugpy, about 0.2 CPU-s
#: a process), and what every rank imports while it joins the group (the package's rank
#: side reads torch's FSDP and DTensor modules, about 0.7 CPU-s a process, mostly sympy).
#: Each of these is otherwise paid N times at once on the start's critical path. None of
#: them starts a thread or installs a trace function on import (checked on torch 2.13.0,
#: ipykernel 7.x).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "ipyparallel.engine.app",
    "ipyparallel.engine.nanny",
    "ipykernel.debugger",
    "fsdp_interactive._torch_compat",
    "fsdp_interactive.pool._engine_shell",
)


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import ``modules``; one that fails to import is reported on stderr and skipped."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the engine reports it where the module is used
            print(f"engine forker: could not preload {name}: {exc}", file=sys.stderr, flush=True)


def check_request(request: Any) -> tuple[str, list[str], dict[str, str], str, str]:
    """Validate a fork request; return ``(module, args, env, cwd, output)``."""
    if not isinstance(request, dict):
        raise ValueError(f"a request must be a JSON object, got {type(request).__name__}")
    argv, env = request.get("argv"), request.get("env")
    cwd, output = request.get("cwd"), request.get("output")
    if not isinstance(request.get("nanny", False), bool):
        raise ValueError("nanny must be true or false")
    if (
        not isinstance(argv, list)
        or len(argv) < 3
        or argv[1] != "-m"
        or not all(isinstance(a, str) for a in argv)
    ):
        raise ValueError(f"argv must be [python, '-m', module, *args], got {argv!r}")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("env must be an object of strings")
    if not isinstance(cwd, str) or not isinstance(output, str) or not output:
        raise ValueError("cwd and output must be strings (output not empty)")
    return argv[2], argv[3:], env, cwd, output


def _become_own_process(output: str) -> None:
    """In a forked child: its own session, stdin from ``/dev/null``, stdout and stderr
    appended to ``output``; SIGINT back to the interpreter's handler (the forker ignores it)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _run_module(module: str, args: list[str], env: dict[str, str], cwd: str) -> int:
    """In the forked child: become a fresh ``python -m module args`` process; its status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    sys.argv = [module, *args]
    # A module the forker imported (the pool's own modules are) runs afresh as __main__,
    # as in a new interpreter, instead of beside its imported copy (runpy warns of that).
    sys.modules.pop(module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _fork(body: Callable[[], int], output: str, close: Iterable[int]) -> int:
    """Fork a child that runs ``body()`` as its own process (see :func:`_become_own_process`)
    and exits with its status; the child's pid (in the parent). Never returns in the child.

    ``close``: descriptors of the forker the child must not keep (0-2 are replaced).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        for fd in close:
            if fd > 2:
                os.close(fd)
        _become_own_process(output)
        status = body()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status & 0xFF if status >= 0 else 1)
    raise AssertionError("unreachable")  # pragma: no cover


def fork_request(request: Any, inherited: list[int]) -> tuple[int, int | None]:
    """Fork what ``request`` asks for; ``(the child's pid, its nanny's pid or None)``.

    ``inherited``: descriptors of the forker no child may keep.
    """
    module, args, env, cwd, output = check_request(request)
    if not request.get("nanny", False):
        return _fork(lambda: _run_module(module, args, env, cwd), output, inherited), None
    pipes = _forked_nanny.make_pipes()
    try:
        args_w, url_r = pipes.engine_ends()
        engine_env = dict(env, **{_forked_nanny.FDS_ENV: f"{args_w},{url_r}"})
        engine = _fork(
            lambda: _run_module(module, args, engine_env, cwd),
            output,
            [*inherited, *pipes.nanny_ends()],
        )
        nanny = _fork(
            lambda: _forked_nanny.run_nanny(*pipes.nanny_ends()),
            output,
            [*inherited, *pipes.engine_ends()],
        )
    finally:
        for fd in pipes.all():
            os.close(fd)
    return engine, nanny


def serve(requests_fd: int, replies_fd: int) -> None:
    """Answer fork requests read from ``requests_fd`` until it closes; report child exits.

    Replies and events are written to ``replies_fd``. Reads are unbuffered (``os.read``),
    so no request can hide in a buffer while the selector waits.
    """

    def send(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(replies_fd, data) :]

    selector = selectors.DefaultSelector()
    selector.register(requests_fd, selectors.EVENT_READ, None)
    children: dict[int, tuple[int, bool]] = {}  # pidfd -> (pid, reported when it ends)

    def watch(pid: int, report: bool) -> None:
        pidfd = os.pidfd_open(pid)
        children[pidfd] = (pid, report)
        selector.register(pidfd, selectors.EVENT_READ, pid)

    pending = b""
    while True:
        for key, _ in selector.select():
            if key.data is not None:
                pidfd = key.fd
                pid, report = children.pop(pidfd)
                _, status = os.waitpid(pid, 0)
                selector.unregister(pidfd)
                os.close(pidfd)
                if report:
                    send({"exited": pid, "exit_code": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(requests_fd, 65536)
            if not chunk:
                selector.close()
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                token = None
                try:
                    request = json.loads(line)
                    token = request.get("token") if isinstance(request, dict) else None
                    inherited = [requests_fd, replies_fd, selector.fileno(), *children]
                    pid, nanny_pid = fork_request(request, inherited)
                except (ValueError, OSError) as exc:
                    send({"token": token, "error": str(exc)})
                    continue
                watch(pid, report=True)
                reply: dict[str, Any] = {"token": token, "pid": pid}
                if nanny_pid is not None:
                    watch(nanny_pid, report=False)
                    reply["nanny_pid"] = nanny_pid
                send(reply)


def main() -> int:
    # The owner's Ctrl-C is not ours: the forker runs in its own session, but be explicit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    preload()
    serve(sys.stdin.fileno(), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    status = main()
    # Nothing is left to clean up (replies are written unbuffered, children are not
    # ours to end): skip the interpreter's finalization, which takes about a second
    # with torch imported and would hold up every pool's stop().
    sys.stderr.flush()
    os._exit(status)
