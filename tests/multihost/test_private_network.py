"""A pool across hosts on a network others can read: it encrypts (CurveZMQ, TLS: see
``test_ssh_pool.py::test_the_network_carries_no_cell_source_output_or_stack``), and runs
unencrypted only when told (``insecure_network=True``), saying so at its start; what
such a pool sends is readable on the network (the capture shows it), which is why it
must be asked for."""

from __future__ import annotations

import os

import pytest
from traitlets.config import Config

from fsdp_interactive.pool import Pool, PoolStartError
from tests.multihost.capture import captured
from tests.multihost.launchers import ssh_pool_kwargs

pytestmark = pytest.mark.multihost


def test_an_unencrypted_pool_across_hosts_starts_only_when_told(
    testhosts, tmp_path_factory, capsys
):
    profile = str(tmp_path_factory.mktemp("insecure-profile"))
    kwargs = ssh_pool_kwargs(testhosts, 1, profile)
    # A controller launcher a config chose: the pool cannot make its channels private.
    chosen = Config(kwargs["config"])
    chosen.Cluster.controller_launcher_class = "ssh"
    refused = Pool(2, devices="cpu", show_topology=False, **{**kwargs, "config": chosen})
    with pytest.raises(PoolStartError, match="insecure_network=True") as refusal:
        refused.start()
    assert "%fsdp start --insecure-network" in str(refusal.value)
    assert refused.launched_pids == {}  # nothing was started

    output = f"out-{os.urandom(6).hex()}"
    pool = Pool(2, devices="cpu", timeout=240, show_topology=False, insecure_network=True, **kwargs)
    with captured(testhosts.head_link) as wire:
        try:
            pool.start()
            said = capsys.readouterr().err
            out = pool.run(f"print({output[:4]!r} + {output[4:]!r})", stream=False)
            assert out.stdout[1].strip() == output
        finally:
            pool.stop()
    assert "not encrypted (insecure_network=True, %fsdp start --insecure-network)" in said
    assert output.encode() in wire  # readable by anyone on the network: hence the refusal
