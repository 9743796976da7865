"""Which ssh hosts get how many engines, and the one ssh command that starts each host's
engine forker, read from ipyparallel's SSHEngineSetLauncher settings (no host is
contacted here; the multihost tests run them)."""

from __future__ import annotations

import shlex

import pytest
from traitlets.config import Config

from fsdp_interactive.pool import Pool, PoolStartError
from fsdp_interactive.pool.processes._pids import still_running
from fsdp_interactive.pool.processes._ssh_forked_launcher import (
    SSHForkedEngineSetLauncher,
    plan_hosts,
)


def launcher(**settings) -> SSHForkedEngineSetLauncher:
    config = Config({"SSHEngineSetLauncher": settings})
    return SSHForkedEngineSetLauncher(config=config, profile_dir="/profile", cluster_id="c")


def test_hosts_are_taken_in_order_with_their_own_settings_up_to_n():
    plan = plan_hosts(
        launcher(
            engines={
                "hosta": 2,
                "me@hostb:2222": {"n": 2, "remote_python": "/opt/py", "ssh_args": ["-tt", "-v"]},
                "hostc": 4,
            },
            remote_python="/usr/bin/python3",
            ssh_args=["-F", "/cfg", "-t"],
            remote_profile_dir="/remote/profile",
        ),
        5,
    )
    assert [(h.key, h.location, h.port, h.n) for h in plan] == [
        ("hosta", "hosta", None, 2),
        ("me@hostb:2222", "me@hostb", "2222", 2),
        ("hostc", "hostc", None, 1),  # the fifth engine; hostc could take four
    ]
    assert plan[0].python == "/usr/bin/python3" and plan[1].python == "/opt/py"
    # terminal allocation would garble the channel: dropped
    assert plan[0].ssh == ("ssh", "-F", "/cfg") and plan[1].ssh == ("ssh", "-v")
    assert {h.profile_dir for h in plan} == {"/remote/profile"}


def test_one_ssh_command_runs_the_hosts_forker_without_a_private_path():
    (host,) = plan_hosts(launcher(engines={"me@hostb:2222": 1}, ssh_args=["-F", "/cfg"]), 1)
    command = host.forker_command()
    assert command[:3] == ["ssh", "-F", "/cfg"]
    assert command[3:5] == ["-p", "2222"] and "-T" in command
    assert "BatchMode=yes" in command and command[-3:-1] == ["me@hostb", "--"]
    remote = shlex.split(command[-1])
    # The snapshot root goes over the channel (the forker's setup line), never on a command line.
    assert remote == ["exec", "python3", "-m", "fsdp_interactive.pool.processes._engine_forker"]
    assert host.file_name == "me_hostb_2222"


@pytest.mark.parametrize(
    ("engines", "n", "message"),
    [
        (
            {"hosta": {"n": 1, "engine_cmd": ["x"]}},
            1,
            r"engines\['hosta'\] sets engine_cmd, which the pool's ssh engines do not take",
        ),
        ({"hosta": "two"}, 1, r"engines\['hosta'\] must be a number of engines"),
        ({"hosta": 1, "hostb": 1}, 3, r"places 2 engine\(s\) \(hosta, hostb\); the pool needs 3"),
        ({}, 1, r"places 0 engine\(s\) \(no hosts\); the pool needs 1"),
    ],
)
def test_settings_the_plan_cannot_follow_are_named(engines, n, message):
    with pytest.raises(ValueError, match=message):
        plan_hosts(launcher(engines=engines), n)


def test_a_pool_asking_more_engines_than_the_hosts_take_fails_before_anything_starts(
    profile_dir,
):
    config = Config({"SSHEngineSetLauncher": {"engines": {"hosta": 1}}})
    pool = Pool(2, devices="cpu", engines="ssh", config=config, profile_dir=profile_dir)
    with pytest.raises(PoolStartError, match=r"places 1 engine\(s\) \(hosta\); the pool needs 2"):
        pool.start()
    assert pool.state == "stopped"
    assert still_running(pool.launched_pids) == []
