"""A one-host pool's channels, tried as another local user (``nobody``) would: connect to
every socket every process of the pool listens on, subscribe where it can, while the pool
runs a cell that prints a secret; nothing is received.

Every listener but gloo's is a unix socket in the pool's socket folder, mode 0700: the
other user cannot even connect. gloo's (one per rank, on loopback: torch authenticates
nothing, docs/security.md) accepts the connection and sends nothing. On the old pool the
same connections received ZeroMQ's greeting from a dozen loopback ports, and a
subscriber the IOPub stream: every cell's source and output.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from fsdp_interactive.pool import Pool
from fsdp_interactive.pool.common import _socket_folder
from tests.second_user import OTHER_UID, as_other_user, require_root


def _pool_processes(pool: Pool) -> list[psutil.Process]:
    found = {}
    for pid in pool.launched_pids:
        try:
            process = psutil.Process(pid)
            found[pid] = process
            for child in process.children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            continue
    return list(found.values())


def _listeners(pool: Pool) -> tuple[dict[str, str], dict[tuple[str, int], str]]:
    """``(unix socket path -> process, (ip, port) -> process)`` of every socket a process
    of the pool listens on (a unix socket bound to a path, a TCP socket listening)."""
    unix, tcp = {}, {}
    for process in _pool_processes(pool):
        try:
            name = " ".join(process.cmdline())[:60]
            for conn in process.net_connections(kind="all"):
                if conn.family == socket.AF_UNIX and conn.laddr:
                    unix[conn.laddr] = name
                elif conn.status == psutil.CONN_LISTEN:
                    tcp[(conn.laddr.ip, conn.laddr.port)] = name
        except psutil.Error:
            continue
    return unix, tcp


def _spy(unix_paths: list[str], tcp: list[tuple[str, int]], ready_w: int, done_r: int) -> Any:
    """As the other user: connect to each socket (and subscribe through ZeroMQ to each unix
    one), say so, wait until the pool ran its cell, then gather what arrived."""
    import zmq

    outcome: dict[str, Any] = {"uid": os.geteuid(), "unix": {}, "tcp": {}, "zmq": []}
    context = zmq.Context()
    subscribers = []
    for path in unix_paths:
        raw = socket.socket(socket.AF_UNIX)
        try:
            raw.connect(path)
            outcome["unix"][path] = "connected"
        except OSError as exc:
            outcome["unix"][path] = type(exc).__name__
        finally:
            raw.close()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{path}")
        subscribers.append(sub)
    open_tcp = {}
    for ip, port in tcp:
        raw = socket.socket(socket.AF_INET)
        raw.settimeout(5)
        raw.connect((ip.encode(), port))  # bytes: as this user, Python cannot load "idna"
        open_tcp[f"{ip}:{port}"] = raw
    os.write(ready_w, b"r")
    os.read(done_r, 1)  # the pool ran its cell and printed its output
    deadline = time.monotonic() + 1.0  # ZeroMQ delivers to every subscriber about at once
    while time.monotonic() < deadline:
        for sub in subscribers:
            while sub.poll(0):
                outcome["zmq"].append(sub.recv_multipart())
        time.sleep(0.05)
    for name, raw in open_tcp.items():
        readable, _, _ = select.select([raw], [], [], 0)
        outcome["tcp"][name] = raw.recv(4096) if readable else b""
        raw.close()
    context.destroy(linger=0)
    return outcome


def test_no_other_user_can_connect_or_subscribe_to_a_one_host_pool(pool: Pool):
    require_root()
    unix, tcp = _listeners(pool)
    folder = pool._processes.socket_folder
    assert folder is not None
    info = os.lstat(folder)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    # every unix socket is in the private folder (no abstract socket: those have no rights)
    assert unix and all(os.path.dirname(path) == folder for path in unix), unix
    names = {os.path.basename(path).split(":")[0].split("-")[0] for path in unix}
    assert names == {"c", "nanny", "heart", "agent"}  # controller, nannies, engines, ranks
    # TCP listens only gloo's, one per rank, in the ranks, on loopback
    ranks = {record.pid for record in pool.topology}
    assert len(tcp) == len(ranks), tcp
    for (ip, _), process in tcp.items():
        assert ip == "127.0.0.1" and process.startswith("fsdp-interactive rank ")

    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    spied: dict[str, Any] = {}

    def spy() -> None:
        try:
            spied["outcome"] = as_other_user(_spy, sorted(unix), sorted(tcp), ready_w, done_r)
        except BaseException as exc:
            spied["error"] = exc
        finally:
            os.close(ready_w)  # the main thread's read ends, also when the spy failed

    thread = threading.Thread(target=spy)
    thread.start()
    try:
        assert os.read(ready_r, 1) == b"r", spied.get("error")
        secret = "SECRET-" + os.urandom(6).hex()
        out = pool.run(f"print({secret!r} * (rank + 1))", stream=False).stdout
        assert secret in out[0] and secret * 2 in out[1]
    finally:
        os.write(done_w, b"d")
        thread.join(60)
        for fd in (ready_r, done_r, done_w):
            os.close(fd)
    outcome = spied["outcome"]
    assert outcome["uid"] == OTHER_UID
    assert set(outcome["unix"].values()) == {"PermissionError"}, outcome["unix"]
    assert outcome["zmq"] == []
    assert set(outcome["tcp"].values()) == {b""}, outcome["tcp"]


def test_the_socket_folder_goes_with_the_pool(profile_dir):
    pool = Pool(n=1, devices="cpu", profile_dir=profile_dir, show_topology=False).start()
    try:
        folder = pool._processes.socket_folder
        assert folder is not None and os.path.basename(folder).startswith(_socket_folder.PREFIX)
        pool.restart()  # kept for the next group
        assert pool._processes.socket_folder == folder and os.path.isdir(folder)
        assert pool.run("rank", stream=False).results == {0: "0"}
    finally:
        pool.stop()
    assert not os.path.lexists(folder)


def test_ipyparallels_logs_and_files_are_private(pool: Pool, profile_dir):
    cluster = pool._processes.cluster
    folder = Path(profile_dir, "log", f"fsdpi-{cluster.cluster_id}")
    info = folder.lstat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    files = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in folder.iterdir()}
    assert Path(cluster.cluster_file) == folder / f"cluster-{cluster.cluster_id}.json"
    kinds = {name.split("-")[0] for name in files}
    assert {"ipcontroller", "ipengine", "cluster"} <= kinds, files
    assert set(files.values()) == {0o600}, files
    # the connection files: 0600 in the profile's private security folder, as ever
    security = Path(profile_dir, "security")
    assert stat.S_IMODE(security.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in security.iterdir()} == {0o600}


def test_a_pool_that_cannot_keep_its_channels_private_refuses_to_start(profile_dir):
    from traitlets.config import Config

    from fsdp_interactive.pool import PoolStartError

    chosen = Config({"Cluster": {"controller_launcher_class": "ssh"}})
    pool = Pool(n=1, devices="cpu", profile_dir=profile_dir, config=chosen, show_topology=False)
    with pytest.raises(PoolStartError) as refused:
        pool.start()
    message = str(refused.value)
    assert "the controller is started by a launcher a config chose" in message
    assert "insecure_network=True (%fsdp start --insecure-network)" in message
    assert pool.launched_pids == {}  # nothing was started


def test_engines_ipyparallel_starts_itself_get_curvezmq_on_top(profile_dir):
    """A config that sets the engine command: ipyparallel's own engines and nannies bind
    loopback ports of their own, which CurveZMQ keeps from completing a handshake."""
    import json
    import sys

    from traitlets.config import Config

    own = Config(
        {"LocalEngineSetLauncher": {"engine_cmd": [sys.executable, "-m", "ipyparallel.engine"]}}
    )
    pool = Pool(n=1, devices="cpu", profile_dir=profile_dir, config=own, show_topology=False)
    try:
        pool.start()
        client_file = pool._processes.cluster.controller.connection_files["client"]
        info = json.loads(Path(client_file).read_text())
        assert info["interface"].startswith(f"ipc://{pool._processes.socket_folder}/")
        assert info["curve_serverkey"]
        assert pool.run("rank", stream=False).results == {0: "0"}
    finally:
        pool.stop()
