"""Which interface a rank's gloo and NCCL sockets bind, decided on the rank's own host."""

from __future__ import annotations

import logging
import os
import socket

import psutil
import pytest

from fsdp_interactive.pool.common._hosts import interface_holding
from fsdp_interactive.pool.rank._bootstrap import SOCKET_IFNAME_VARS, bind_collective_sockets


def _loopback_interface() -> str:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    pytest.fail("this host has no interface with 127.0.0.1")


def _routable_address() -> tuple[str, str]:
    """``(interface, address)`` of one non-loopback IPv4 address of this host."""
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return name, a.address
    pytest.skip("this host has no non-loopback IPv4 address")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No socket interface variable set; whatever the test sets is undone afterwards."""
    for var in SOCKET_IFNAME_VARS:
        monkeypatch.setenv(var, "")  # recorded, so that the end of the test restores it
        monkeypatch.delenv(var)
    return monkeypatch


def test_the_interface_holding_an_address_is_found():
    assert interface_holding("127.0.0.1") == _loopback_interface()
    name, address = _routable_address()
    assert interface_holding(address) == name
    assert interface_holding("192.0.2.77") is None  # TEST-NET-1: on no interface here
    assert interface_holding("not-an-address") is None


def test_a_cpu_rank_binds_gloo_to_the_interface_of_its_address(clean_env):
    name, address = _routable_address()
    assert bind_collective_sockets(address, cuda=False) == {"GLOO_SOCKET_IFNAME": name}
    assert "NCCL_SOCKET_IFNAME" not in os.environ


def test_a_cuda_rank_binds_gloo_and_nccl(clean_env):
    name, address = _routable_address()
    assert bind_collective_sockets(address, cuda=True) == {
        "GLOO_SOCKET_IFNAME": name,
        "NCCL_SOCKET_IFNAME": name,
    }


def test_a_users_choice_is_kept(clean_env):
    _, address = _routable_address()
    clean_env.setenv("GLOO_SOCKET_IFNAME", "chosen0")
    assert bind_collective_sockets(address, cuda=True) == {
        "GLOO_SOCKET_IFNAME": "chosen0",
        "NCCL_SOCKET_IFNAME": _routable_address()[0],
    }


def test_a_single_host_pool_changes_nothing(clean_env):
    assert bind_collective_sockets(None, cuda=True) == {}


@pytest.mark.parametrize("address", ["127.0.1.1", "192.0.2.77"])
def test_a_loopback_or_foreign_address_is_not_pinned_and_warns(clean_env, caplog, address):
    with caplog.at_level(logging.WARNING, logger="fsdp_interactive.pool.rank._bootstrap"):
        assert bind_collective_sockets(address, cuda=False) == {}
    assert f"address {address} is" in caplog.text and "GLOO_SOCKET_IFNAME left unset" in caplog.text
