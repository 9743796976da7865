"""ipyparallel's engine nanny, forked ready-made beside its engine.

Every ipyparallel engine has a nanny: a process that relays signals to the engine and
tells the controller at once when the engine exits. ipyparallel starts it in the middle
of the engine's registration as a fresh interpreter that imports ipyparallel (about
0.3 CPU-s each, on the start's critical path), and the engine waits for it. The engine
forker (:mod:`._engine_forker`) has ipyparallel imported already, so it forks each
engine's nanny together with the engine, joined to it by two pipes; at registration the
engine hands the nanny its arguments and has its address back within milliseconds.

Both halves of ipyparallel's own protocol are kept (``ipyparallel.engine.nanny``,
checked on ipyparallel 9.2.0): the engine writes a pickled dict of ``KernelNanny``'s
keyword arguments and closes that pipe; the nanny answers with its control socket's URL
on one line and keeps its end of the other pipe open while it runs, so that each side
sees the other end. The one difference: a nanny whose engine never sends the arguments
(it ended first, or started ipyparallel's own nanny) exits quietly.

* forker side: :func:`make_pipes` before forking, :meth:`Pipes.engine_ends` and
  :meth:`Pipes.nanny_ends` for the two children, :func:`run_nanny` in the nanny's child;
* engine side: :meth:`NannyPipes.from_environment` (the descriptors travel in
  :data:`FDS_ENV`) and :meth:`NannyPipes.hand_over`.

The nanny relays the controller's control messages to its engine through a socket it
binds and the engine connects to. ipyparallel binds it on loopback TCP, where any local
user could connect and, the socket dealing messages out in turn, take some of them; in a
one-host pool (the engine hands over its socket folder,
:mod:`fsdp_interactive.pool.common._socket_folder`) it is a unix socket in that folder
instead (:class:`_PrivateNanny`).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import IO, Any

from fsdp_interactive.pool.common import _socket_folder

#: The engine's two descriptors, "ARGS_W,URL_R", in its environment (taken out at once).
FDS_ENV = "FSDPI_NANNY_FDS"


@dataclass(frozen=True)
class Pipes:
    """The four ends of the engine-nanny pipes, as the forker made them."""

    args_read: int
    args_write: int
    url_read: int
    url_write: int

    def all(self) -> tuple[int, int, int, int]:
        return (self.args_read, self.args_write, self.url_read, self.url_write)

    def engine_ends(self) -> tuple[int, int]:
        """The ends the engine keeps: it writes the arguments and reads the URL."""
        return self.args_write, self.url_read

    def nanny_ends(self) -> tuple[int, int]:
        """The ends the nanny keeps: it reads the arguments and writes the URL."""
        return self.args_read, self.url_write


def make_pipes() -> Pipes:
    """Two pipes: arguments engine -> nanny, URL nanny -> engine (inheritable by forks)."""
    args_read, args_write = os.pipe()
    url_read, url_write = os.pipe()
    return Pipes(args_read, args_write, url_read, url_write)


def run_nanny(args_fd: int, url_fd: int) -> int:
    """In the nanny's child: wait for the engine's arguments, then run ipyparallel's nanny
    until the engine ends; the exit status (0 also when no arguments came)."""
    from ipyparallel.engine.nanny import KernelNanny

    from fsdp_interactive.pool.common._process_title import set_title

    with os.fdopen(args_fd, "rb") as args_pipe:
        data = args_pipe.read()
    if not data:
        os.close(url_fd)
        return 0
    kwargs = pickle.loads(data)
    set_title(f"ipyparallel nanny of engine pid {kwargs.get('pid')} (fsdp-interactive)")
    kwargs["pipe"] = os.fdopen(url_fd, "w", buffering=1)
    folder = kwargs.pop(SOCKET_FOLDER_KEY, None)
    if folder:
        _private_nanny_class().main(socket_folder=folder, **kwargs)
    else:
        KernelNanny.main(**kwargs)
    return 0


#: The key of the nanny's arguments that names the pool's socket folder (the engine adds
#: it; ipyparallel's own nanny does not take it).
SOCKET_FOLDER_KEY = "fsdpi_socket_folder"


def _private_nanny_class() -> Any:
    """ipyparallel's ``KernelNanny`` whose relay socket is a unix socket in the pool's
    socket folder (checked on ipyparallel 9.2.0, whose ``KernelNanny.start`` this repeats
    but for that socket's address)."""
    import signal
    from threading import Thread

    import zmq
    from ipyparallel import util
    from ipyparallel.engine.nanny import KernelNanny
    from tornado.ioloop import IOLoop
    from zmq.eventloop.zmqstream import ZMQStream

    from fsdp_interactive.pool.common._socket_folder import ipc_url

    class _PrivateNanny(KernelNanny):
        def __init__(self, *, socket_folder: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.relay_url = ipc_url(socket_folder, f"nanny-{os.getpid()}")

        async def start(self) -> None:
            self._watcher_thread = Thread(
                target=self.wait_for_parent_thread, name="WatchParent", daemon=True
            )
            self._watcher_thread.start()
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a SIGINT is the engine's
            self.loop = IOLoop.current()
            self.context = zmq.Context()
            self.control_socket = self.context.socket(zmq.ROUTER)
            self.control_socket.identity = self.identity
            util.connect(
                self.control_socket, self.control_url, curve_serverkey=self.curve_serverkey
            )
            self.control_stream = ZMQStream(self.control_socket)
            self.control_stream.on_recv_stream(self.dispatch_control)
            self.parent_socket = self.context.socket(zmq.DEALER)
            if self.curve_secretkey:
                self.parent_socket.setsockopt(zmq.CURVE_SERVER, 1)
                self.parent_socket.setsockopt(zmq.CURVE_SECRETKEY, self.curve_secretkey)
            self.parent_socket.bind(self.relay_url)
            self.pipe.write(f"{self.relay_url}\n")
            self.loop.add_handler(self.pipe, self.pipe_handler, IOLoop.READ | IOLoop.ERROR)
            self.parent_stream = ZMQStream(self.parent_socket)
            self.parent_stream.on_recv_stream(self.dispatch_parent)

    return _PrivateNanny


class NannyPipes:
    """The engine's ends of the pipes to the nanny the forker started with it.

    Exactly one of :meth:`hand_over` and :meth:`discard` is called, once.
    """

    def __init__(self, args_fd: int, url_fd: int) -> None:
        self._args_fd: int | None = args_fd
        self._url = os.fdopen(url_fd, "r")

    @classmethod
    def from_environment(cls) -> NannyPipes | None:
        """The pipes named by :data:`FDS_ENV` (removed from the environment), if any."""
        value = os.environ.pop(FDS_ENV, "")
        try:
            args_fd, url_fd = (int(part) for part in value.split(","))
            os.fstat(args_fd)
            os.fstat(url_fd)
        except (ValueError, OSError):
            return None
        return cls(args_fd, url_fd)

    def hand_over(self, **nanny_kwargs: Any) -> tuple[str, IO[str]]:
        """Give the nanny ``nanny_kwargs`` (those of ipyparallel's ``start_nanny``, whose
        ``pid`` is set here); return ``(its control URL, the pipe to keep open)``.

        Raises ``RuntimeError`` when the nanny is gone or ends without answering.
        """
        nanny_kwargs["pid"] = os.getpid()
        folder = os.environ.get(_socket_folder.ENV_VAR)
        if folder:
            nanny_kwargs[SOCKET_FOLDER_KEY] = folder
        data = pickle.dumps(nanny_kwargs)
        assert self._args_fd is not None, "hand_over or discard was called already"
        fd, self._args_fd = self._args_fd, None
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError as exc:
            raise RuntimeError(f"the forked nanny is gone: {exc}") from None
        finally:
            os.close(fd)
        url = self._url.readline().strip()
        if not url:
            self._url.close()
            raise RuntimeError("the forked nanny ended without telling its URL")
        return url, self._url

    def discard(self) -> None:
        """Let the nanny go without using it (it exits when the arguments pipe closes)."""
        if self._args_fd is not None:
            os.close(self._args_fd)
            self._args_fd = None
        self._url.close()
