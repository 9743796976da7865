"""A process that imports torch and ipyparallel's engine once, then forks engine processes.

``python -m fsdp_interactive.pool.processes._engine_forker`` speaks JSON lines: it reads
requests on stdin and writes replies and events on stdout. It exists
because importing torch takes seconds of CPU in every new process; engines forked from a
process that has imported it start without that cost (and share its memory pages until
they write to them). The pool runs one on its own host, and one on every ssh host, with
ssh's stdin and stdout as the channel (:mod:`._ssh_forked_launcher`).

Protocol (one JSON object per line):

* setup ``{"snapshot_root": DIR or null, "adopt": false}``, the first line the owner
  writes (:mod:`._forker_setup`: the pool's private path is on no command line): before
  importing anything, the forker creates ``DIR`` as a private folder (mode 0700, refused
  when it exists, is a link or is another user's); with a refused root, every fork
  request is answered with the reason;
* event ``{"ready": true, "pid": P, "host": H, "snapshot_root": "created" | "adopted" |
  null, "snapshot_root_error": null | "..."}`` once, when the imports are done;
* request ``{"token": T, "argv": [...], "env": {...}, "cwd": DIR, "output": FILE}``: fork a
  child that runs ``argv`` as ``python -m MODULE ARGS`` would (``argv`` must have that
  shape: ``[python, "-m", MODULE, *ARGS]``), in its own session, with stdin from
  ``/dev/null``, stdout and stderr appended to ``FILE`` (its folder is created),
  exactly the environment ``env`` (with ``"extend_env": true``: the forker's own
  environment updated with ``env``) and working directory ``DIR`` (``null``: the
  forker's). With a snapshot root, the child also finds it in ``$FSDPI_SNAPSHOT_ROOT``.
  With ``"nanny": true`` the child is an ipyparallel engine: the forker also forks the
  engine's nanny, ready-made, in its own session with its output in ``FILE`` too, and
  the engine finds its ends of the pipes to it in ``$FSDPI_NANNY_FDS``
  (:mod:`._forked_nanny`). With ``"collect_output": true`` the child's exit event
  carries the last :data:`._forked_children.OUTPUT_TAIL_BYTES` of ``FILE``, which is then removed;
* reply ``{"token": T, "pid": P}`` (and ``"nanny_pid"`` with a nanny), or
  ``{"token": T, "error": "..."}`` when the request is malformed or the fork failed;
* request ``{"signal": S, "pid": P}``: send signal ``S`` to child ``P`` if it is one of
  this forker's children and has not been reaped (so the pid is still its own); no reply;
* request ``{"warm": [SPEC, ...]}``: import these modules here too, so that children
  forked afterwards find them loaded (:mod:`._warm_imports`: installed packages only,
  tried first in a throwaway fork that must start no thread and leave CUDA alone); done
  between requests. Answered, once done, by the event ``{"warmed": [...], "skipped":
  {SPEC: reason}}`` (specs warmed before are left out of both);
* request ``{"precheck": SNAPSHOT_ID}``: hash the files of this host's copy of that
  snapshot (in the snapshot root) in a child that runs only on idle CPUs, and record their
  checksums in the snapshot's folder for the restore that follows
  (:mod:`fsdp_interactive.checkpoint._format._prechecked`); no reply (the record is the result, its
  end is logged on stderr). A precheck of a snapshot already being prechecked is not
  started twice;
* event ``{"exited": P, "exit_code": C}`` (and ``"output"``, see above) when child ``P``
  ends (``C`` negative: killed by signal ``-C``), as ``subprocess`` reports it. A nanny's
  end is not reported: it ends after its engine, whose end is. An engine that ends while
  the forker imports for a warm request (seconds for a large package) is reported at
  once too, from a ``SIGCHLD`` handler that runs between the import's bytecodes: the
  kernel waits only seconds for the status of a rank it found dead, and would otherwise
  report it as unknown.

The forker writes nothing else on stdout; its own diagnostics go to stderr. It exits
when its stdin closes (its owner stopped it, or the owner or the ssh connection to it
is gone), or on SIGTERM or SIGHUP. Then it ends the children still running (SIGTERM,
SIGKILL after :data:`END_GRACE_S`), reporting their ends while its owner still
listens, and removes the snapshot root it made (never a folder it refused). A rank that dies does not
end it. SIGKILL does, and so does SIGTERM or SIGHUP in the first moments, while the
interpreter still loads the package and :func:`main` has not taken the signals: then
the root stays, and the orphan reaper (on the kernel's host) removes it.

Fork safety: the forker never starts a thread itself and never runs a torch operation
(so no intra-op thread pool exists), never touches CUDA, and opens no ZeroMQ context;
the one thread that importing numpy may start is OpenBLAS's, which shuts itself down
around ``fork`` (its ``pthread_atfork`` handlers). Children re-seed numpy's global random
state, as independent processes would have different ones (Python's ``random`` is
re-seeded by the interpreter itself). SIGTERM and SIGHUP are blocked around each fork
and set back to their defaults in the child, so that the forker's own handlers never
run in an engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.checkpoint._format import _prechecked
from fsdp_interactive.pool.common import _snapshot_root
from fsdp_interactive.pool.processes import _warm_imports
from fsdp_interactive.pool.processes._forked_children import (
    ENDING_SIGNALS,
    fork_child,
    fork_request,
    output_tail,
)
from fsdp_interactive.pool.processes._forker_setup import RootState, prepare_root, read_setup

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
    "fsdp_interactive.pool.rank._engine_shell",
)
#: Seconds children get after SIGTERM, when the forker exits, before SIGKILL.
END_GRACE_S = 3.0


class _Ending(BaseException):
    """Raised by the SIGTERM/SIGHUP handler while the forker starts: it exits at once (a
    ``BaseException``, so that the preloads' ``except Exception`` lets it through)."""


#: Set by the SIGTERM/SIGHUP handler while the forker serves (the wake-up pipe wakes it).
_ending: list[str] = []


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import ``modules``; one that fails to import is reported on stderr and skipped.

    The cyclic garbage collector is off meanwhile: imports make many objects and few
    cycles, and its passes cost about a sixth of the imports' CPU time (torch 2.13). What
    the imports made is then frozen (``gc.freeze``): the children's collections never
    walk those objects, so they neither spend time on them nor copy the pages that hold
    them.
    """
    import gc
    import importlib

    gc.disable()
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as exc:  # the engine reports it where the module is used
                print(
                    f"engine forker: could not preload {name}: {exc}", file=sys.stderr, flush=True
                )
    finally:
        gc.freeze()
        gc.enable()


@dataclass
class _Child:
    pid: int
    report: bool  # its end is reported (an engine or plain child; not a nanny)
    output: str | None = None  # collected and removed when it ends
    on_end: Callable[[int], None] | None = None  # called with its exit code once reaped


class _Server:
    """The forker's state while it serves: its children, watched through pidfds, and the
    wake-up pipe through which an ending signal interrupts the wait."""

    def __init__(self, requests_fd: int, replies_fd: int, root: RootState) -> None:
        self.requests_fd = requests_fd
        self.replies_fd = replies_fd
        self.snapshot_root = root.path if root.refused is None else None
        self.refusal = root.refused
        self.selector = selectors.DefaultSelector()
        self.selector.register(requests_fd, selectors.EVENT_READ, "requests")
        self.wakeup_r, self.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "wakeup")
        self.children: dict[int, _Child] = {}  # pidfd -> child
        self.owner_listens = True
        self.warmed: set[str] = set()  # import specs imported here (see warm)
        self.warming: set[str] = set()  # being probed
        self.refused: dict[str, str] = {}  # never to be tried again, with the reason
        self.prechecking: set[str] = set()  # snapshot ids being prechecked

    def own_descriptors(self) -> list[int]:
        """Descriptors of the forker that no child may keep."""
        return [
            self.requests_fd,
            self.replies_fd,
            self.selector.fileno(),
            self.wakeup_r,
            self.wakeup_w,
            *self.children,
        ]

    def send(self, message: dict[str, Any]) -> None:
        """Write one line to the owner; a closed channel means the owner is gone."""
        if not self.owner_listens:
            return
        data = (json.dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.replies_fd, data) :]
        except OSError:
            self.owner_listens = False

    def watch(self, child: _Child) -> None:
        pidfd = os.pidfd_open(child.pid)
        self.children[pidfd] = child
        self.selector.register(pidfd, selectors.EVENT_READ, child)

    def reap_event(self, key: selectors.SelectorKey) -> None:
        """Reap the child whose pidfd the selector reported, unless it was reaped since
        the selector looked: a child's end reaped from the ``SIGCHLD`` handler while an
        earlier event of the same batch ran a warm import, whose pidfd may even have been
        reused by a child forked since (then ``key`` names another child object)."""
        if self.children.get(key.fd) is key.data:
            self.reap(key.fd)

    def reap(self, pidfd: int) -> None:
        """Collect the ended child behind ``pidfd`` and report it."""
        child = self.children.pop(pidfd)
        _, status = os.waitpid(child.pid, 0)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        if child.on_end is not None:
            child.on_end(os.waitstatus_to_exitcode(status))
        if not child.report:
            return
        event: dict[str, Any] = {
            "exited": child.pid,
            "exit_code": os.waitstatus_to_exitcode(status),
        }
        if child.output is not None:
            event["output"] = output_tail(child.output)
            with contextlib.suppress(OSError):
                os.remove(child.output)
        self.send(event)

    def signal_child(self, pid: Any, sig: Any) -> None:
        """Signal ``pid`` if it is an unreaped child (its pid cannot be another's yet)."""
        if not isinstance(pid, int) or not isinstance(sig, int):
            return
        if any(child.pid == pid for child in self.children.values()):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

    def handle(self, line: bytes) -> None:
        token = None
        try:
            request = json.loads(line)
            if isinstance(request, dict) and "signal" in request:
                self.signal_child(request.get("pid"), request.get("signal"))
                return
            if isinstance(request, dict) and "warm" in request:
                self.warm(request["warm"])
                return
            if isinstance(request, dict) and "precheck" in request:
                self.precheck(request["precheck"])
                return
            token = request.get("token") if isinstance(request, dict) else None
            if self.refusal is not None:
                raise ValueError(self.refusal)
            pid, nanny_pid = fork_request(request, self.own_descriptors(), self.snapshot_root)
        except (ValueError, OSError) as exc:
            self.send({"token": token, "error": str(exc)})
            return
        collect = request.get("collect_output") is True
        self.watch(_Child(pid, report=True, output=request["output"] if collect else None))
        reply: dict[str, Any] = {"token": token, "pid": pid}
        if nanny_pid is not None:
            self.watch(_Child(nanny_pid, report=False))
            reply["nanny_pid"] = nanny_pid
        self.send(reply)

    def warm(self, specs: Any) -> None:
        """Probe ``specs`` in a throwaway fork; :meth:`_probed` imports them here after."""
        try:
            asked = list(dict.fromkeys(_warm_imports.check_specs(specs)))
        except ValueError as exc:
            self.send({"warmed": [], "skipped": {}, "error": str(exc)})
            return
        fresh = [
            s for s in asked if not (s in self.warmed or s in self.warming or s in self.refused)
        ]
        if not fresh:
            self.send(
                {"warmed": [], "skipped": {s: self.refused[s] for s in asked if s in self.refused}}
            )
            return
        fd, report = tempfile.mkstemp(prefix="fsdpi-warm-", suffix=".json")
        os.close(fd)
        body = lambda: _warm_imports.run_probe(fresh, report)  # noqa: E731
        pid = fork_child(body, os.devnull, self.own_descriptors())
        self.warming.update(fresh)
        self.watch(_Child(pid, report=False, on_end=lambda code: self._probed(fresh, report, code)))

    def _probed(self, specs: list[str], report: str, exit_code: int) -> None:
        """The probe of ``specs`` ended: import what it found safe, and say what was done."""
        self.warming.difference_update(specs)
        settled = _warm_imports.settle(specs, report, exit_code)
        if _ending:
            self.send({"warmed": [], "skipped": dict.fromkeys(specs, "the forker is ending")})
            return
        with self._reporting_engine_ends():
            done, failed = _warm_imports.import_here(settled.to_import)
        skipped = {**settled.skipped, **failed}
        self.warmed.update(done)
        self.refused.update(skipped)
        print(f"engine forker: warmed {done}; skipped {skipped}", file=sys.stderr, flush=True)
        self.send({"warmed": done, "skipped": skipped})
        for spec in settled.alone:
            self.warm([spec])

    @contextlib.contextmanager
    def _reporting_engine_ends(self) -> Iterator[None]:
        """While the forker runs long Python code outside its loop (a warm request's
        imports): reap and report every engine that ends, at once, from a ``SIGCHLD``
        handler (run between bytecodes, on this thread: nothing else writes the replies
        meanwhile). Other children wait for the loop."""

        def report_ended(signum: int, frame: Any) -> None:
            for pidfd, child in list(self.children.items()):
                if child.report and child.on_end is None and _has_ended(child.pid):
                    self.reap(pidfd)

        previous = signal.signal(signal.SIGCHLD, report_ended)
        try:
            report_ended(signal.SIGCHLD, None)  # one that ended before the handler was set
            yield
        finally:
            signal.signal(signal.SIGCHLD, previous)

    def precheck(self, snapshot_id: Any) -> None:
        """Hash the snapshot ``snapshot_id`` of this host's root in a child that runs only on
        idle CPUs (:func:`_precheck_child`); returns at once."""
        if self.snapshot_root is None or not _prechecked.is_snapshot_name(snapshot_id):
            print(f"engine forker: no precheck of {snapshot_id!r}", file=sys.stderr, flush=True)
            return
        if snapshot_id in self.prechecking:
            return
        folder = os.path.join(self.snapshot_root, snapshot_id)
        began = time.monotonic()
        pid = fork_child(lambda: _precheck_child(folder), os.devnull, self.own_descriptors())
        self.prechecking.add(snapshot_id)

        def ended(code: int) -> None:
            self.prechecking.discard(snapshot_id)
            outcome = "recorded" if code == 0 else f"failed (exit code {code}); nothing recorded"
            print(
                f"engine forker: precheck of {folder} {outcome} in {time.monotonic() - began:.2f}s",
                file=sys.stderr,
                flush=True,
            )

        self.watch(_Child(pid, report=False, on_end=ended))

    def serve(self, pending: bytes = b"") -> None:
        """Answer requests (``pending``: bytes read before) until the requests' channel
        closes or an ending signal comes; report child exits."""
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                self.handle(line)
        while not _ending:
            for key, _ in self.selector.select():
                if key.data == "wakeup":
                    with contextlib.suppress(OSError):
                        os.read(self.wakeup_r, 512)
                    continue
                if key.data != "requests":
                    self.reap_event(key)
                    continue
                chunk = os.read(self.requests_fd, 65536)
                if not chunk:
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.handle(line)
        print(f"engine forker: ending on {_ending[0]}", file=sys.stderr, flush=True)

    def end_children(self, grace: float = END_GRACE_S) -> None:
        """SIGTERM every child still running, SIGKILL those left after ``grace`` seconds;
        reap (and report) them all."""
        self.selector.unregister(self.requests_fd)
        self.selector.unregister(self.wakeup_r)
        if not self.children:
            return
        print(
            f"engine forker: ending {len(self.children)} children still running",
            file=sys.stderr,
            flush=True,
        )
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for child in list(self.children.values()):
                with contextlib.suppress(OSError):
                    os.kill(child.pid, sig)
            deadline = time.monotonic() + grace
            while self.children and time.monotonic() < deadline:
                for key, _ in self.selector.select(max(0.0, deadline - time.monotonic())):
                    self.reap_event(key)
            if not self.children:
                return

    def close(self) -> None:
        self.selector.close()
        signal.set_wakeup_fd(-1)
        os.close(self.wakeup_r)
        os.close(self.wakeup_w)


def _has_ended(pid: int) -> bool:
    """Whether child ``pid`` has ended, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False


def serve(requests_fd: int, replies_fd: int, root: RootState, pending: bytes = b"") -> None:
    """Answer fork requests read from ``requests_fd`` (``pending``: bytes of it read
    before) until it closes, or until SIGTERM or SIGHUP comes; report child exits. Then end
    the children still running and remove the snapshot root ``root`` made. Call it on the
    main thread (it takes over those two signals).

    Replies and events are written to ``replies_fd``. Reads are unbuffered (``os.read``),
    so no request can hide in a buffer while the selector waits.
    """
    server = _Server(requests_fd, replies_fd, root)
    for sig in ENDING_SIGNALS:
        signal.signal(sig, _note_ending)
    signal.set_wakeup_fd(server.wakeup_w)
    try:
        server.serve(pending)
    finally:
        # A second SIGTERM must not cut the clean-up short.
        for sig in ENDING_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        server.end_children()
        server.close()
        _remove_snapshot_root(root.owned)


def _precheck_child(folder: str) -> int:
    """In a forked child: :func:`fsdp_interactive.checkpoint._format._prechecked.precheck` of
    ``folder`` under ``SCHED_IDLE`` (it runs only on a CPU nothing else wants: the engines being
    started are never slowed by it); its exit status."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _prechecked.precheck(folder)
    return 0


def _remove_snapshot_root(path: str | None) -> None:
    try:
        if _snapshot_root.remove_root(path):
            print(f"engine forker: removed the snapshot root {path}", file=sys.stderr, flush=True)
    except ValueError as exc:
        print(f"engine forker: {exc}; left in place", file=sys.stderr, flush=True)


def _raise_ending(signum: int, frame: Any) -> None:
    raise _Ending(signal.Signals(signum).name)


def _note_ending(signum: int, frame: Any) -> None:
    _ending.append(signal.Signals(signum).name)


def main() -> int:
    # The owner's Ctrl-C is not ours: the forker runs in its own session, but be explicit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in ENDING_SIGNALS:
        signal.signal(sig, _raise_ending)
    root = RootState()
    try:
        setup, pending = read_setup(sys.stdin.fileno())
        # An ending signal while the root is made is held until ``root`` says it was made,
        # so that the handler below removes it (raised between the mkdir and the return,
        # it would leave the root to the orphan reaper).
        held = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING_SIGNALS)
        try:
            root = prepare_root(setup)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if root.refused:
            print(f"engine forker: {root.refused}", file=sys.stderr, flush=True)
        preload()
        _warm_imports.prepare_forker()
        ready = {"ready": True, "pid": os.getpid(), "host": socket.gethostname(), **root.report()}
        with contextlib.suppress(OSError):
            os.write(sys.stdout.fileno(), (json.dumps(ready) + "\n").encode())
        serve(sys.stdin.fileno(), sys.stdout.fileno(), root, pending)
    except _Ending as ending:  # before serve() took the signals over: nothing was forked
        print(f"engine forker: ending on {ending} while starting", file=sys.stderr, flush=True)
        _remove_snapshot_root(root.owned)
    return 0


if __name__ == "__main__":
    status = main()
    # Nothing is left to clean up (replies are written unbuffered, children were
    # ended): skip the interpreter's finalization, which takes about a second with
    # torch imported and would hold up every pool's stop().
    sys.stderr.flush()
    os._exit(status)
