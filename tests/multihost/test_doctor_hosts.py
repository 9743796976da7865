"""``fsdp-interactive doctor --hosts``: reachability, versions and a cross-host all_reduce."""

from __future__ import annotations

import pytest

from fsdp_interactive.cli import main
from tests.multihost.conftest import left_on_hosts

pytestmark = pytest.mark.multihost


def doctor(testhosts, hosts: str, *more: str) -> list[str]:
    return [
        "doctor",
        "--hosts",
        hosts,
        "--controller-ip",
        testhosts.head_address,
        "--ssh-config",
        testhosts.ssh_config,
        *more,
    ]


def test_doctor_checks_every_host_and_an_all_reduce_across_them(
    testhosts, tmp_path_factory, capsys
):
    profile_dir = str(tmp_path_factory.mktemp("doctor-profile"))
    assert main(doctor(testhosts, "hosta,hostb", "--profile-dir", profile_dir)) == 0
    out = capsys.readouterr().out
    assert "[ ok ] hosts: every host answered over ssh with this kernel's versions" in out
    assert "[ ok ] cross-host all_reduce (gloo): 2 ranks on hosta, hostb up in" in out, out
    assert out.rstrip().endswith("PASS")
    assert left_on_hosts(testhosts) == {}


def test_doctor_names_a_host_that_does_not_answer(testhosts, capsys):
    assert main(doctor(testhosts, f"hosta,{testhosts.unused_address}")) == 1
    out = capsys.readouterr().out
    assert f"{testhosts.unused_address}: cannot run its remote_python over ssh" in out, out
    assert "cross-host all_reduce" not in out
    assert out.rstrip().endswith("FAIL")
