"""How the engine forker (:mod:`._engine_forker`) makes a child: a fork request checked,
and a forked process of its own (its own session, its output in a file) that runs a
module as ``python -m`` would, or any body the forker gives it.

The forker's ending signals (:data:`ENDING_SIGNALS`) are blocked across each fork and set
back to their defaults in the child, so that the forker's own handlers never run there.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.pool.common import _snapshot_root
from fsdp_interactive.pool.processes import _forked_nanny

#: How much of a child's output its exit event carries (``"collect_output"``).
OUTPUT_TAIL_BYTES = 64 * 1024
#: The signals that end the forker (its handlers must never run in a child).
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class ForkRequest:
    """A checked fork request (see the module's protocol)."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str | None
    output: str
    nanny: bool = False
    extend_env: bool = False
    collect_output: bool = False


def check_request(request: Any) -> ForkRequest:
    """Validate a fork request."""
    if not isinstance(request, dict):
        raise ValueError(f"a request must be a JSON object, got {type(request).__name__}")
    argv, env = request.get("argv"), request.get("env")
    cwd, output = request.get("cwd"), request.get("output")
    for flag in ("nanny", "extend_env", "collect_output"):
        if not isinstance(request.get(flag, False), bool):
            raise ValueError(f"{flag} must be true or false")
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
    if (cwd is not None and not isinstance(cwd, str)) or not isinstance(output, str) or not output:
        raise ValueError("cwd and output must be strings (output not empty; cwd may be null)")
    return ForkRequest(
        module=argv[2],
        args=argv[3:],
        env=env,
        cwd=cwd,
        output=output,
        nanny=request.get("nanny", False),
        extend_env=request.get("extend_env", False),
        collect_output=request.get("collect_output", False),
    )


def _become_own_process(output: str) -> None:
    """In a forked child: its own session, stdin from ``/dev/null``, stdout and stderr
    appended to ``output``; SIGINT back to the interpreter's handler (the forker ignores it)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    folder = os.path.dirname(output)
    if folder:
        os.makedirs(folder, exist_ok=True)
    log = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _run_module(module: str, args: list[str], env: dict[str, str], cwd: str | None) -> int:
    """In the forked child: become a fresh ``python -m module args`` process; its status."""
    if cwd is not None:
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


def fork_child(body: Callable[[], int], output: str, close: Iterable[int]) -> int:
    """Fork a child that runs ``body()`` as its own process (see :func:`_become_own_process`)
    and exits with its status; the child's pid (in the parent). Never returns in the child.

    ``close``: descriptors of the forker the child must not keep (0-2 are replaced).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    # The forker's ending handlers must never run in a child: blocked across the fork,
    # set back to the defaults in the child before they are unblocked.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING_SIGNALS)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return pid
    status = 1
    try:
        # The forker's wake-up pipe is closed below: its number must not be written to.
        signal.set_wakeup_fd(-1)
        for sig in ENDING_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
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


def child_environment(request: ForkRequest, snapshot_root: str | None) -> dict[str, str]:
    """The environment a child of ``request`` gets (see the module's protocol)."""
    env = {**os.environ, **request.env} if request.extend_env else dict(request.env)
    if snapshot_root:
        env[_snapshot_root.ENV_VAR] = snapshot_root
    return env


def fork_request(
    request: Any, inherited: list[int], snapshot_root: str | None = None
) -> tuple[int, int | None]:
    """Fork what ``request`` asks for; ``(the child's pid, its nanny's pid or None)``.

    ``inherited``: descriptors of the forker no child may keep.
    """
    checked = check_request(request)
    module, args, cwd, output = checked.module, checked.args, checked.cwd, checked.output
    env = child_environment(checked, snapshot_root)
    if not checked.nanny:
        return fork_child(lambda: _run_module(module, args, env, cwd), output, inherited), None
    pipes = _forked_nanny.make_pipes()
    try:
        args_w, url_r = pipes.engine_ends()
        engine_env = dict(env, **{_forked_nanny.FDS_ENV: f"{args_w},{url_r}"})
        engine = fork_child(
            lambda: _run_module(module, args, engine_env, cwd),
            output,
            [*inherited, *pipes.nanny_ends()],
        )
        nanny = fork_child(
            lambda: _forked_nanny.run_nanny(*pipes.nanny_ends()),
            output,
            [*inherited, *pipes.engine_ends()],
        )
    finally:
        for fd in pipes.all():
            os.close(fd)
    return engine, nanny


def output_tail(path: str, size: int = OUTPUT_TAIL_BYTES) -> str:
    """The last ``size`` bytes of ``path``, from the start of a line ("" when unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            length = f.tell()
            f.seek(max(0, length - size))
            data = f.read()
    except OSError:
        return ""
    if length > size and b"\n" in data:
        data = data[data.index(b"\n") + 1 :]
    return data.decode(errors="replace")
