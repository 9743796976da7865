"""What the pool checks about hosts: which addresses are this host's, and which
versions a rank on another host runs.

* :func:`check_controller_ip`: the controller can listen only on an address of this
  host (or on every interface); checked before anything starts.
* :func:`interface_holding`: the network interface that holds an address (the one a
  rank's collective sockets are bound to).
* :func:`version_mismatches` / :func:`describe_mismatches`: torch, fsdp_interactive
  and Python of a rank against this kernel's; ranks that differ are refused when the
  group forms, naming both versions.

Imports nothing but the standard library and psutil (``torch`` is never imported here:
versions come from the distributions' metadata).
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import platform
import socket
from collections.abc import Mapping

import psutil

#: Distributions whose releases must agree between the kernel and every rank.
CHECKED_DISTRIBUTIONS = ("torch", "fsdp-interactive")
_WILDCARDS = ("*", "0.0.0.0", "", "::")


def local_addresses() -> set[str]:
    """Every IPv4 and IPv6 address of this host's interfaces."""
    found = set()
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                found.add(a.address.split("%")[0])
    return found


def interface_holding(address: str) -> str | None:
    """The name of this host's network interface that holds the IP ``address``
    (``None``: no interface holds it). The first one in ``psutil``'s order when
    several do."""
    try:
        wanted = str(ipaddress.ip_address(address))
    except ValueError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == wanted:
                return name
    return None


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback IP address (``127.0.0.0/8``, ``::1``)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_controller_ip(value: object) -> None:
    """Refuse a ``controller_ip`` that this host cannot listen on.

    A wildcard (``"*"``, ``"0.0.0.0"``) is accepted; anything else must be an IP address
    of one of this host's interfaces. ``ValueError`` says which addresses there are.
    """
    if value is None or value in _WILDCARDS:
        return
    if not isinstance(value, str):
        raise ValueError(f"controller_ip must be an IP address (str), got {value!r}")
    try:
        address = str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(
            f"controller_ip must be an IP address of this host or '*', got {value!r}"
        ) from None
    here = local_addresses()
    if address not in here:
        shown = ", ".join(sorted(a for a in here if ":" not in a))
        raise ValueError(
            f"controller_ip={value!r} is not an address of this host "
            f"({socket.gethostname()}: {shown}); the controller can only listen on one "
            "of those, or on '*' (all interfaces)"
        )


def versions() -> dict[str, str | None]:
    """Python's version and that of each of :data:`CHECKED_DISTRIBUTIONS` (``None``:
    not installed), from the distributions' metadata."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in CHECKED_DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _release(version: str | None) -> str | None:
    """A version without its local part (``2.13.0+cpu`` -> ``2.13.0``)."""
    return version.split("+")[0] if version else version


def version_mismatches(
    here: Mapping[str, str | None], there: Mapping[str, str | None]
) -> dict[str, tuple[str | None, str | None]]:
    """``name -> (here, there)`` for each version a pool cannot mix.

    torch and fsdp_interactive must be the same release (a CPU and a CUDA build of one
    torch release mix), Python the same minor version
    (functions travel pickled by value).
    """
    found: dict[str, tuple[str | None, str | None]] = {}
    for name in CHECKED_DISTRIBUTIONS:
        if name in here and name in there and _release(here[name]) != _release(there[name]):
            found[name] = (here[name], there[name])
    py_here, py_there = here.get("python"), there.get("python")
    if py_here and py_there and py_here.split(".")[:2] != py_there.split(".")[:2]:
        found["python"] = (py_here, py_there)
    return found


def describe_mismatches(where: str, mismatches: Mapping[str, tuple[str | None, str | None]]) -> str:
    """One line naming both versions of each mismatch, e.g. for a start-up error."""
    parts = [
        f"{name} {there or 'not installed'} there, {here or 'not installed'} in this kernel"
        for name, (here, there) in mismatches.items()
    ]
    return f"{where}: " + "; ".join(parts)
