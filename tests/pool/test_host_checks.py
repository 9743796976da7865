"""Checks of what a pool is told about hosts, made before anything starts."""

from __future__ import annotations

import pytest

from fsdp_interactive.pool import Pool, PoolStartError
from fsdp_interactive.pool._rendezvous import refuse_other_versions
from fsdp_interactive.pool.common._hosts import check_controller_ip, versions


@pytest.mark.parametrize("value", [None, "*", "0.0.0.0", "127.0.0.1"])
def test_a_controller_ip_of_this_host_or_a_wildcard_is_taken(value):
    check_controller_ip(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("192.0.2.77", "controller_ip='192.0.2.77' is not an address of this host"),
        ("not-an-address", "controller_ip must be an IP address of this host or '\\*'"),
        (5, "controller_ip must be an IP address \\(str\\), got 5"),
    ],
)
def test_a_controller_ip_this_host_cannot_listen_on_is_refused(value, expected):
    with pytest.raises(ValueError, match=expected):
        Pool(2, devices="cpu", engines="ssh", controller_ip=value)


def test_ranks_with_another_torch_are_refused_naming_both_versions():
    here = versions()
    same = {"host": "hosta", "python": "/usr/bin/python3", "versions": dict(here)}
    # Below the range pyproject.toml admits, so it differs from the torch of every lane.
    other = {
        "host": "hostb",
        "python": "/opt/venv/bin/python",
        "versions": {**here, "torch": "2.8.0+cu128"},
    }
    refuse_other_versions({0: same})
    with pytest.raises(PoolStartError) as caught:
        refuse_other_versions({0: same, 1: other})
    message = str(caught.value)
    assert "engine 1 on hostb (/opt/venv/bin/python)" in message
    assert f"torch 2.8.0+cu128 there, {here['torch']} in this kernel" in message
    assert "hosta" not in message


def test_a_cpu_and_a_cuda_build_of_one_torch_release_mix():
    here = versions()
    build = {**here, "torch": (here["torch"] or "").split("+")[0] + "+cu128"}
    refuse_other_versions({0: {"host": "hostb", "python": "p", "versions": build}})
