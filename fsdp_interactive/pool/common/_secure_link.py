"""An encrypted diagnostics connection across hosts: TLS without certificates, its peer
proven by the channel's key bound to the TLS session.

The diagnostics channel between the kernel and a rank on another host carries what the
rank holds: stacks with their source lines, the debugger's output (any value a person
prints), snapshot records. On the network it is encrypted with TLS 1.2
(``ADH-AES256-GCM-SHA384``: an ephemeral Diffie-Hellman exchange in RFC 7919's
``ffdhe2048`` group, AES-256-GCM) from the standard library's ``ssl``. Neither side has a
certificate: each proves that it holds the pool's channel key by the HMAC challenge of
:mod:`._agent_wire`, under a key bound to this TLS session (``HMAC-SHA256(channel key,
tls-unique)``, RFC 5929's channel binding). A man in the middle holds two TLS sessions
with two different bindings, so neither challenge it relays verifies: it can read
nothing and is refused. Anonymous cipher suites are enabled at OpenSSL security level 0,
which is what allows a suite without a certificate; the key exchange and the cipher are
the strong ones named above.

:class:`SecureLink` has the part of :class:`multiprocessing.connection.Connection` the
channel uses (``send``, ``recv``, ``send_bytes``, ``recv_bytes``, ``poll``,
``fileno``, ``close``), so the HMAC challenge and the agent run on it unchanged. Standard
library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import pickle
import select
import socket
import ssl
import struct
import tempfile
from typing import Any

#: RFC 7919's ffdhe2048 group (public, fixed parameters).
_FFDHE2048 = b"""-----BEGIN DH PARAMETERS-----
MIIBCAKCAQEA//////////+t+FRYortKmq/cViAnPTzx2LnFg84tNpWp4TZBFGQz
+8yTnc4kmz75fS/jY2MMddj2gbICrsRhetPfHtXV/WVhJDP1H18GbtCFY2VVPe0a
87VXE15/V8k1mE8McODmi3fipona8+/och3xWKE2rec1MKzKT0g6eXq8CrGCsyT7
YdEIqUuyyOP7uWrat2DX9GgdT0Kj3jlN9K5W7edjcrsZCwenyO4KbXCeAvzhzffi
7MA0BM0oNC9hkXL+nOmFg/+OTxIy7vKBg8P+OxtMb61zO7X8vC7CIAXFjvGDfRaD
ssbzSibBsu/6iGtCOGEoXJf//////////wIBAg==
-----END DH PARAMETERS-----
"""
CIPHER = "ADH-AES256-GCM-SHA384"
_BINDING_LABEL = b"fsdp-interactive diagnostics tls-unique "
_contexts: dict[bool, ssl.SSLContext] = {}


def context(*, server: bool) -> ssl.SSLContext:
    """The TLS context of one side (made once per process); ``ssl.SSLError`` where this
    OpenSSL lacks the suite."""
    if server not in _contexts:
        made = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        made.check_hostname = False
        made.verify_mode = ssl.CERT_NONE  # no certificates: the bound challenge proves the peer
        # TLS 1.2: tls-unique is defined there, and it is where anonymous suites exist.
        made.minimum_version = made.maximum_version = ssl.TLSVersion.TLSv1_2
        made.set_ciphers(f"{CIPHER}:@SECLEVEL=0")
        if server:
            with tempfile.NamedTemporaryFile(suffix=".pem") as params:
                params.write(_FFDHE2048)
                params.flush()
                made.load_dh_params(params.name)
        _contexts[server] = made
    return _contexts[server]


def bound_key(channel_key: bytes, tls: ssl.SSLSocket) -> bytes:
    """The challenge key of one TLS session: the channel key bound to its ``tls-unique``."""
    binding = tls.get_channel_binding("tls-unique")
    if not binding:
        raise ssl.SSLError("the TLS session gives no channel binding")
    return hmac.new(channel_key, _BINDING_LABEL + binding, hashlib.sha256).digest()


def wrap(sock: socket.socket, *, server: bool) -> ssl.SSLSocket:
    """``sock`` (connected, blocking, its time limits set) after the TLS handshake."""
    return context(server=server).wrap_socket(sock, server_side=server)


class SecureLink:
    """Frames (a 4-byte length, then the bytes) over a TLS socket, as
    ``multiprocessing.connection.Connection`` frames them."""

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self._tls = tls
        self.secure = True

    def fileno(self) -> int:
        return self._tls.fileno()

    def send_bytes(self, data: bytes) -> None:
        self._tls.sendall(struct.pack("!i", len(data)) + bytes(data))

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        (size,) = struct.unpack("!i", self._exactly(4))
        if size < 0 or (maxlength is not None and size > maxlength):
            raise OSError(f"bad message length {size}")
        return self._exactly(size)

    def send(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj))

    def recv(self) -> Any:
        return pickle.loads(self.recv_bytes())  # only ever after both sides authenticated

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message (or the end) can be read without waiting longer than
        ``timeout``; TLS may hold decrypted bytes the descriptor no longer shows."""
        if self._tls.pending():
            return True
        readable, _, _ = select.select([self._tls], [], [], timeout)
        return bool(readable)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._tls.close()

    def _exactly(self, count: int) -> bytes:
        parts, left = [], count
        while left:
            chunk = self._tls.recv(min(left, 1 << 20))
            if not chunk:
                raise EOFError("the peer closed the diagnostics connection")
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)


def available() -> str | None:
    """Why this Python's OpenSSL cannot make the encrypted link (``None``: it can)."""
    try:
        context(server=True)
        context(server=False)
    except (ssl.SSLError, ValueError, OSError) as exc:
        return f"OpenSSL {ssl.OPENSSL_VERSION} offers no {CIPHER} ({exc})"
    return None
