"""The wire of the diagnostics channel: authenticated connections with time limits.

Both ends use :mod:`multiprocessing.connection`'s HMAC challenge, in both directions
(each side proves it holds the key before anything else is read), then exchange pickled
dicts (:func:`send`, ``recv``). Unpickling happens only after both sides authenticated,
as with ``multiprocessing.connection.Listener(authkey=...)``; the handshake is done here
rather than in ``Listener.accept`` so that it runs under a time limit, on the
connection's own thread (a peer that connects and says nothing cannot hold up the agent).

Time limits are the sockets' own (``SO_RCVTIMEO``/``SO_SNDTIMEO``): the descriptors stay
blocking, as ``Connection`` expects, and a read that waits too long fails with an
``OSError`` instead of blocking forever.

The key of a pool is derived, never sent: ``HMAC-SHA256(cluster key, label + nonce)``,
where the cluster key is the ipyparallel HMAC key the kernel and the engines already
share (it is in their connection files) and the nonce is fresh per pool start.

Private, not only authenticated: a connection's first byte says how it goes on. ``P``
(plain): the challenges, then frames in clear, for a unix socket in a private folder (a
pool's socket folder, an attachable job's folder: no other user can connect to it or see
its traffic) and for a fault link, which carries a goodbye and faulthandler's dumps
(file names, line numbers and function names, no values). ``S`` (secure): TLS first,
then the challenges under a key bound to the TLS session (:mod:`._secure_link`), for
everything a rank on another host sends the kernel (a pool's ranks; an attachable job's
that listen on TCP). An agent that listens on TCP answers plain connections only with a
fault link (:data:`PLAIN_OPS`).

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

from fsdp_interactive.pool.common import _secure_link

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
    """Switch on TCP keepalive (see :data:`KEEPALIVE_IDLE_S`) on the socket ``fd`` (a unix
    socket needs none: its peer's end closes with the peer's process)."""
    sock = socket.socket(fileno=fd)
    try:
        if sock.family == socket.AF_UNIX:
            return
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


#: Where an agent listens: ``(host, port)``, or the path of a unix socket.
Address = tuple[str, int] | str


def is_unix(address: Address) -> bool:
    """Whether ``address`` is a unix socket's path rather than ``(host, port)``."""
    return isinstance(address, str)


def send(conn: Any, message: Any) -> None:
    """Send ``message`` pickled by the standard pickler. ``Connection.send`` uses
    multiprocessing's pickler, for which torch registers reductions that send a tensor as
    a handle to shared memory (fit for a child process, not for a peer over a socket);
    the standard pickler sends a tensor's bytes. ``recv`` reads either."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def shut(conn: Any) -> None:
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


#: What a plain connection may ask of an agent that listens on TCP.
PLAIN_OPS = ("fault_link",)
_PLAIN, _SECURE = b"P", b"S"


def connect(address: Address, authkey: bytes, timeout: float, *, secure: bool | None = None) -> Any:
    """An authenticated connection to the agent at ``address`` (``(host, port)``, or the
    path of a unix socket); reads bounded by ``timeout``. ``secure``: TLS (see the
    module); ``None``: for a TCP address, not for a unix socket.

    Raises ``OSError`` (including ``TimeoutError`` and ``ssl.SSLError``) when the agent
    cannot be reached or does not answer in time, and
    ``multiprocessing.AuthenticationError`` on a key mismatch.
    """
    if isinstance(address, str):  # a unix socket
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
    else:
        sock = socket.create_connection(address, timeout=timeout)
    if secure is None:
        secure = not is_unix(address)
    sock.settimeout(None)  # blocking descriptor; the bound below applies instead
    _no_delay(sock)
    set_timeout(sock, timeout)
    try:
        sock.sendall(_SECURE if secure else _PLAIN)
        if secure:
            tls = _secure_link.wrap(sock, server=False)
            return _handshake(
                _secure_link.SecureLink(tls), _secure_link.bound_key(authkey, tls), server=False
            )
    except BaseException:
        sock.close()
        raise
    return _handshake(Connection(sock.detach()), authkey, server=False)


def accept(sock: socket.socket, authkey: bytes) -> Any:
    """Authenticate an accepted socket (the server side of :func:`connect`); the
    connection's ``secure`` attribute says whether it came over TLS.

    The handshake is bounded by :data:`HANDSHAKE_TIMEOUT_S`; afterwards reads wait
    without bound. Raises as :func:`connect` does; the socket is closed then.
    """
    set_timeout(sock, HANDSHAKE_TIMEOUT_S)
    _no_delay(sock)
    try:
        mode = sock.recv(1)
        if mode not in (_PLAIN, _SECURE):
            raise ConnectionError(f"not a diagnostics connection (first byte {mode!r})")
        if mode == _SECURE:
            tls = _secure_link.wrap(sock, server=True)
            conn: Any = _handshake(
                _secure_link.SecureLink(tls), _secure_link.bound_key(authkey, tls), server=True
            )
        else:
            conn = _handshake(Connection(sock.detach()), authkey, server=True)
            conn.secure = False
    except BaseException:
        sock.close()
        raise
    set_timeout(conn.fileno(), None)
    return conn


def _no_delay(sock: socket.socket) -> None:
    """Send small messages at once: the handshake and a request are several small writes,
    which Nagle's algorithm would hold back for the peer's delayed acknowledgement (about
    40 ms per exchange)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _handshake(conn: Any, authkey: bytes, *, server: bool) -> Any:
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
