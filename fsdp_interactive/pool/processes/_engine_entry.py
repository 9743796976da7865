"""The command a forked engine runs: wait for the controller's connection file, then run.

``python -m fsdp_interactive.pool.processes._engine_entry [--connection-file PATH --wait S]
[-- ARGS]``

A plain ``ipengine`` needs the controller's connection file to exist when it starts, so
ipyparallel's ``Cluster`` starts engines only once the controller has written it. With
this entry the pool starts the engines together with the controller (forked from
:mod:`._engine_forker`, which has torch imported already):

1. wait until ``PATH`` (the controller's engine connection file) holds a complete JSON
   document: the controller writes it non-atomically, so existence is not enough. After
   ``S`` seconds without one, exit with status 1 and say why on stderr;
2. hand the document to the engine as ``$IPP_CONNECTION_INFO`` (as ``Cluster`` does when
   it starts engines after the controller) and run ipyparallel's engine application
   with ``ARGS``.

Without ``--connection-file`` (engines on other hosts, forked once the controller is up)
the connection info must already be in ``$IPP_CONNECTION_INFO``; the engine runs at once.

The engine lets the process named in ``$FSDPI_TRACER_PID`` (the kernel) read its stack
with py-spy where Yama allows only named tracers (:func:`.common._py_spy.allow_tracing_by`):
a start that times out shows where an engine that never registered is stuck.

Forked with a nanny (the forker's ``"nanny"`` requests, :mod:`._forked_nanny`), the engine
hands that ready-made nanny its arguments at registration instead of starting one; it
starts ipyparallel's own should that nanny be missing or fail.

In a one-host pool (its socket folder in ``$FSDPI_SOCKET_FOLDER``,
:mod:`fsdp_interactive.pool.common._socket_folder`) the engine's own listener, the socket
its heart reports each controller ping to, is a unix socket in that folder instead of
loopback TCP, where any local user could reach it (and the nanny's relay socket, see
:mod:`._forked_nanny`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from fsdp_interactive.pool.common import _py_spy, _socket_folder
from fsdp_interactive.pool.processes._forked_nanny import NannyPipes

_POLL_S = 0.02


def read_connection_info(path: str, wait_s: float) -> str:
    """The text of ``path`` once it parses as a JSON object with ``key`` and ``interface``.

    Raises ``TimeoutError`` after ``wait_s`` seconds without such a document.
    """
    deadline = time.monotonic() + wait_s
    while True:
        info = _complete_document(path)
        if info is not None:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the controller's connection file {path} did not appear (complete) "
                f"within {wait_s:g}s"
            )
        time.sleep(_POLL_S)


def _complete_document(path: str) -> str | None:
    try:
        with open(path) as f:
            text = f.read()
        parsed: Any = json.loads(text)
    except (OSError, ValueError):
        return None
    if isinstance(parsed, dict) and "key" in parsed and "interface" in parsed:
        return text
    return None


def engine_command(connection_file: str, wait_s: float) -> list[str]:
    """The ``engine_cmd`` for ipyparallel's local launchers that runs this entry."""
    return [
        sys.executable,
        "-m",
        "fsdp_interactive.pool.processes._engine_entry",
        "--connection-file",
        connection_file,
        "--wait",
        f"{wait_s:g}",
        "--",
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_interactive.pool.processes._engine_entry",
        description="Wait for the controller's connection file, then run an engine.",
    )
    parser.add_argument("--connection-file", help="the controller's engine file")
    parser.add_argument("--wait", type=float, default=None, help="seconds to wait for it")
    return parser


def remote_engine_command(python: str) -> list[str]:
    """The ``engine_cmd`` of an engine forked on another host, whose connection info
    comes in ``$IPP_CONNECTION_INFO``; ``python`` is that host's (see :mod:`._engine_forker`)."""
    return [python, "-m", "fsdp_interactive.pool.processes._engine_entry", "--"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, engine_args = argv, []
    if "--" in argv:
        split = argv.index("--")
        own, engine_args = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(own)
    problem = _check_arguments(args.connection_file, args.wait)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    # Until its agent answers, the kernel reads this engine's stack with py-spy.
    _py_spy.allow_tracing_by(_py_spy.tracer_from_environment())
    nanny = NannyPipes.from_environment()
    if args.connection_file is not None:
        try:
            os.environ["IPP_CONNECTION_INFO"] = read_connection_info(
                args.connection_file, args.wait
            )
        except TimeoutError as exc:
            if nanny is not None:
                nanny.discard()
            print(f"engine not started: {exc}", file=sys.stderr, flush=True)
            return 1
    engine = _engine_class()
    engine.forked_nanny = nanny
    engine.launch_instance(argv=engine_args)
    return 0


def _check_arguments(connection_file: str | None, wait: float | None) -> str | None:
    """What is wrong with the entry's own arguments (``None``: nothing)."""
    if connection_file is None:
        if wait is not None:
            return "--wait needs --connection-file"
        if not os.environ.get("IPP_CONNECTION_INFO"):
            return "without --connection-file, $IPP_CONNECTION_INFO must hold the connection info"
        return None
    if wait is None or wait <= 0:
        return f"--wait must be a positive number of seconds, got {wait}"
    return None


def _engine_class() -> Any:
    """ipyparallel's ``IPEngine``, handing its nanny's arguments to a forked nanny."""
    from ipyparallel.engine.app import IPEngine
    from traitlets.config import Config

    class IPEngineWithForkedNanny(IPEngine):
        #: The pipes to the nanny forked with this engine; taken by the first ``start_nanny``.
        forked_nanny: NannyPipes | None = None

        def start_nanny(self, control_url: str) -> tuple[str, Any]:
            nanny, type(self).forked_nanny = type(self).forked_nanny, None
            if nanny is None:
                return super().start_nanny(control_url)
            config = Config()
            config.Session = self.config.Session
            # The keyword arguments ipyparallel's own IPEngine.start_nanny passes
            # (ipyparallel 9.2.0); a nanny that refuses them is replaced by its own.
            try:
                url, pipe = nanny.hand_over(
                    engine_id=self.id,
                    identity=self.bident,
                    control_url=control_url,
                    curve_serverkey=self.curve_serverkey,
                    curve_secretkey=self.curve_secretkey,
                    curve_publickey=self.curve_publickey,
                    registration_url=self.registration_url,
                    config=config,
                )
            except RuntimeError as exc:
                self.log.warning("%s; starting ipyparallel's own nanny", exc)
                return super().start_nanny(control_url)
            self.log.info("the nanny forked with this engine serves %s", url)
            return url, pipe

        def start_heartbeat(
            self, hb_ping: str, hb_pong: str, hb_period: int, identity: bytes
        ) -> None:
            folder = os.environ.get(_socket_folder.ENV_VAR)
            if not folder or self.max_heartbeat_misses <= 0:
                super().start_heartbeat(hb_ping, hb_pong, hb_period, identity)
                return
            _start_private_heartbeat(self, folder, hb_ping, hb_pong, hb_period, identity)

    return IPEngineWithForkedNanny


def _start_private_heartbeat(
    engine: Any, folder: str, hb_ping: str, hb_pong: str, hb_period: int, identity: bytes
) -> None:
    """ipyparallel 9.2.0's ``IPEngine.start_heartbeat`` (with its monitor on), the monitor
    socket bound in the pool's socket ``folder`` instead of on loopback TCP."""
    import zmq
    from ipyparallel.controller.heartmonitor import Heart
    from tornado import ioloop
    from zmq.eventloop import zmqstream

    monitor_url = _socket_folder.ipc_url(folder, f"heart-{os.getpid()}")
    monitor = engine.context.socket(zmq.SUB)
    if engine.curve_serverkey:
        monitor.setsockopt(zmq.CURVE_SERVER, 1)
        monitor.setsockopt(zmq.CURVE_SECRETKEY, engine.curve_secretkey)
    monitor.bind(monitor_url)
    monitor.setsockopt(zmq.SUBSCRIBE, b"")
    engine._hb_listener = zmqstream.ZMQStream(monitor, engine.loop)
    engine._hb_listener.on_recv(engine._report_ping)
    heart = Heart(
        hb_ping,
        hb_pong,
        monitor_url,
        heart_id=identity,
        curve_serverkey=engine.curve_serverkey,
        curve_secretkey=engine.curve_secretkey,
        curve_publickey=engine.curve_publickey,
    )
    heart.start()
    # A little longer than the controller's period, as ipyparallel checks it.
    engine.hb_check_period = hb_period + 500
    engine._hb_reporter = ioloop.PeriodicCallback(engine._hb_monitor, engine.hb_check_period)
    engine._hb_reporter.start()


if __name__ == "__main__":
    raise SystemExit(main())
