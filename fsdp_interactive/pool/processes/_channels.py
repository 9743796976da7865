"""How a pool's message channels are kept from other users: unix sockets on one host,
CurveZMQ across hosts, or, when asked for in so many words, neither.

ipyparallel's channels (the controller's queues, IOPub, heartbeats, registration) carry
every cell's source, every rank's output and every result. Its default, TCP with HMAC
signatures, lets any local user subscribe to the IOPub port on loopback and read all of
it, and anyone on the network read it when the controller listens there. So a pool:

* with every engine on the kernel's host (``engines="local"``, no ``controller_ip``):
  puts every listener in its private socket folder
  (:mod:`fsdp_interactive.pool.common._socket_folder`): the controller's channels use
  ipyparallel's ``ipc`` transport (:mod:`._controller_entry`), each engine's nanny and
  heartbeat monitor bind there (:mod:`._forked_nanny`, :mod:`._engine_entry`). Engines
  ipyparallel starts itself (a ``config`` that sets the engine command) bind their own
  loopback ports: CurveZMQ is switched on as well, so that those ports complete no
  handshake without the controller's public key;
* with engines elsewhere (``ssh``, ``slurm``, ``mpi``, a ``controller_ip``): switches on
  CurveZMQ (encryption and authentication; the controller's key pair is made in the
  controller, its public key reaches the engines and the kernel in the connection info);
* refuses to start (:class:`PoolStartError`) when it cannot do either, because the
  controller is started by a launcher a ``config`` chose, unless ``insecure_network=True``
  (``%fsdp start --insecure-network``) says that the network is trusted; with it the
  channels are left as ipyparallel makes them (TCP, signed, not encrypted), and the
  start says so.

A pool that connects to a running cluster (``Pool.connect``) takes its channels as they
are: unix sockets in a private folder of this user, or CurveZMQ; plain TCP is refused
unless ``insecure_network=True`` (:func:`check_connected_channels`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from fsdp_interactive import _private_files
from fsdp_interactive.pool.errors import PoolStartError

#: What the pool's start says when it runs with ``insecure_network=True``.
INSECURE_NOTE = (
    "this pool's channels are not encrypted (insecure_network=True, %fsdp start "
    "--insecure-network): every cell's source and every rank's output cross the network in "
    "clear; use it only on a network that nobody else can read"
)


@dataclass(frozen=True)
class Channels:
    """``ipc``: the controller listens in the pool's socket folder; ``curve``: CurveZMQ on
    every channel; ``insecure``: neither, as ``insecure_network=True`` allowed;
    ``configurable``: the controller is ipyparallel's local one, which the pool starts
    through its own entry (private logs and files, umask 077) whatever the channels."""

    ipc: bool
    curve: bool
    insecure: bool = False
    configurable: bool = True

    def describe(self) -> str:
        if self.insecure:
            return "TCP, not encrypted (insecure_network=True)"
        parts = ["unix sockets in the pool's private folder"] if self.ipc else []
        if self.curve:
            parts.append("CurveZMQ")
        return " + ".join(parts)


def choose(
    *,
    engines: Any,
    forked: bool,
    controller_ip: Any,
    local_controller: bool,
    insecure_network: bool,
) -> Channels:
    """The channels of a pool that starts its engines with ``engines`` (``forked``: from
    the pool's engine forker on this host), its controller at ``controller_ip`` (``None``:
    loopback) with ipyparallel's local controller launcher (``local_controller``)."""
    if not local_controller:
        if insecure_network:
            return Channels(ipc=False, curve=False, insecure=True, configurable=False)
        raise PoolStartError(
            "the controller is started by a launcher a config chose, so the pool cannot make "
            "its channels private (unix sockets on one host, CurveZMQ across hosts) and will "
            "not start with every cell's source and output readable by others; use "
            "ipyparallel's local controller launcher, or, on a network nobody else can read, "
            "pass insecure_network=True (%fsdp start --insecure-network)"
        )
    one_host = engines == "local" and not controller_ip
    if one_host:
        return Channels(ipc=True, curve=not forked)
    if insecure_network:
        return Channels(ipc=False, curve=False, insecure=True)
    return Channels(ipc=False, curve=True)


def check_connected_channels(client: Any, *, insecure_network: bool) -> bool:
    """Refuse (:class:`PoolStartError`) a running cluster whose channels other users can
    read (plain TCP, or unix sockets in a folder that is not a private folder of this
    user), unless ``insecure_network``; ``client`` is an ``ipyparallel.Client`` of it.
    Whether its channels are such (and allowed)."""
    info = getattr(client, "_config", None) or {}  # the connection info it connected with
    interface = str(info.get("interface") or "")
    if info.get("curve_serverkey"):
        return False
    if interface.startswith("ipc://"):
        folder = os.path.dirname(interface[len("ipc://") :])
        try:
            _private_files.check_private_folder(folder)
            return False
        except OSError as exc:
            why = f"its unix sockets lie in {folder}, which {getattr(exc, 'reason', exc)}"
    else:
        why = f"it listens on {interface or 'TCP'} without CurveZMQ"
    if insecure_network:
        return True
    raise PoolStartError(
        f"refusing to use the cluster: {why}, so other users can read every cell's source "
        "and output. Start it with CurveZMQ (ipcontroller --IPController.enable_curve=True) "
        "or, on one host, on unix sockets in a private folder; or, on a network nobody else "
        "can read, pass Pool.connect(..., insecure_network=True)"
    )
