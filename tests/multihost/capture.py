"""Capturing what crosses the simulated network, as someone on that network could.

:func:`captured` reads every frame on one interface (this machine's end of the link to
the hosts, :attr:`HostSet.head_link`) with a raw packet socket, the way ``tcpdump``
does, and hands back all their bytes, for a test to look for what must not be readable
there. Root only (``CAP_NET_RAW``), as the simulated hosts are.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

_ETH_P_ALL = 0x0003


@contextlib.contextmanager
def captured(interface: str) -> Iterator[bytearray]:
    """Every frame sent or received on ``interface`` while the block runs, concatenated
    (filled in as they come: read it after the block)."""
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(_ETH_P_ALL))
    sniffer.bind((interface, 0))
    sniffer.settimeout(0.1)
    frames = bytearray()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, socket.timeout):
                frames.extend(sniffer.recv(1 << 18))  # offloaded segments reach 64 KiB

    reader = threading.Thread(target=read, name="capture", daemon=True)
    reader.start()
    try:
        yield frames
    finally:
        stop.set()
        reader.join(5)
        sniffer.close()
