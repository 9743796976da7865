"""The wire of the diagnostics channel: authenticated connections with time limits.

Both ends use :mod:`multiprocessing.connection`'s HMAC challenge, in both directions
(each side proves it holds the key before anything else is read), then exchange
pickled dicts with ``Connection.send``/``recv``. Unpickling happens only after both
sides authenticated, as with ``multiprocessing.connection.Listener(authkey=...)``; the
handshake is done here rather than in ``Listener.accept`` so that it runs under a time
limit, on the connection's own thread (a peer that connects and says nothing cannot
hold up the agent).

Time limits are the sockets' own (``SO_RCVTIMEO``/``SO_SNDTIMEO``): the descriptors stay
blocking, as ``Connection`` expects, and a read that waits too long fails with an
``OSError`` instead of blocking forever.

The key of a pool is derived, never sent: ``HMAC-SHA256(cluster key, label + nonce)``,
where the cluster key is the ipyparallel HMAC key the kernel and the engines already
share (it is in their connection files) and the nonce is fresh per pool start.
Free of torch, IPython and ipyparallel: both sides import it.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import signal
import socket
import struct
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

_KEY_LABEL = b"fsdp-interactive diagnostics channel "
#: Signal that makes a rank write every thread's Python stack to its fault link: the
#: channel's fallback for a rank whose agent cannot answer.
STACK_SIGNAL = signal.SIGUSR1
#: How long a peer may take to complete the handshake.
HANDSHAKE_TIMEOUT_S = 5.0


def derive_key(cluster_key: bytes, nonce: bytes) -> bytes:
    """The channel key of one pool start: HMAC-SHA256 of ``nonce`` under the cluster key."""
    if not cluster_key:
        raise ValueError(
            "the cluster has no HMAC key; the diagnostics channel needs the key the "
            "kernel and the engines share (ipyparallel's Session.key)"
        )
    return hmac.new(cluster_key, _KEY_LABEL + nonce, hashlib.sha256).digest()


def set_timeout(sock_or_fd: socket.socket | int, seconds: float | None) -> None:
    """Bound every blocking read and write on the socket (``None``: no bound)."""
    fd = sock_or_fd if isinstance(sock_or_fd, int) else sock_or_fd.fileno()
    sock = socket.socket(fileno=fd)
    try:
        whole = int(seconds or 0)
        micro = int(((seconds or 0) - whole) * 1e6)
        value = struct.pack("ll", whole, micro)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    finally:
        sock.detach()  # the descriptor belongs to the caller


#: What the kernel sends on a fault link before closing it on purpose (see
#: :mod:`pool.rank._agent`: a link that ends without it means the kernel is gone).
GOODBYE = "goodbye"
#: TCP keepalive of long-lived links: a peer whose host vanished (no FIN, no RST) is
#: noticed after about ``idle + interval * count`` seconds.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 2, 3


def keep_alive(fd: int) -> None:
    """Switch on TCP keepalive (see :data:`KEEPALIVE_IDLE_S`) on the socket ``fd``."""
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    finally:
        sock.detach()  # the descriptor belongs to the caller


def peer_gone(fd: int) -> bool:
    """Whether the peer of socket ``fd`` closed it or the connection broke (reads
    nothing: what waits in the socket stays there)."""
    sock = socket.socket(fileno=fd)
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # reset, timed out by keepalive
    finally:
        sock.detach()
    return data == b""


#: Where an agent listens: ``(host, port)``, or the path of a Unix socket.
Address = tuple[str, int] | str


def send(conn: Connection, message: Any) -> None:
    """Send ``message`` pickled by the standard pickler. ``Connection.send`` uses
    multiprocessing's pickler, for which torch registers reductions that send a tensor as
    a handle to shared memory (fit for a child process, not for a peer over a socket);
    the standard pickler sends a tensor's bytes. ``Connection.recv`` reads either."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def shut(conn: Connection) -> None:
    """Close ``conn``, waking a thread that waits to read from it (``close`` alone would
    leave it waiting on a descriptor number that may be reused); never raises."""
    try:
        sock = socket.socket(fileno=conn.fileno())
    except (OSError, ValueError):
        return  # closed already
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()
    conn.close()


def connect(address: Address, authkey: bytes, timeout: float) -> Connection:
    """An authenticated connection to the agent at ``address``; reads bounded by ``timeout``.

    Raises ``OSError`` (including ``TimeoutError``) when the agent cannot be reached or
    does not answer in time, and ``multiprocessing.AuthenticationError`` on a key
    mismatch.
    """
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
    else:
        sock = socket.create_connection(address, timeout=timeout)
    sock.settimeout(None)  # blocking descriptor; the bound below applies instead
    _no_delay(sock)
    set_timeout(sock, timeout)
    return _handshake(Connection(sock.detach()), authkey, server=False)


def accept(sock: socket.socket, authkey: bytes) -> Connection:
    """Authenticate an accepted socket (the server side of :func:`connect`).

    The handshake is bounded by :data:`HANDSHAKE_TIMEOUT_S`; afterwards reads wait
    without bound. Raises as :func:`connect` does; the socket is closed then.
    """
    set_timeout(sock, HANDSHAKE_TIMEOUT_S)
    _no_delay(sock)
    conn = _handshake(Connection(sock.detach()), authkey, server=True)
    set_timeout(conn.fileno(), None)
    return conn


def _no_delay(sock: socket.socket) -> None:
    """Send small messages at once: the handshake and a request are several small writes,
    which Nagle's algorithm would hold back for the peer's delayed acknowledgement (about
    40 ms per exchange)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _handshake(conn: Connection, authkey: bytes, *, server: bool) -> Connection:
    """Both challenges, the server's first (as ``Listener``/``Client`` order them); the
    connection is closed when either fails."""
    try:
        if server:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn
