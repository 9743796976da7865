"""An ssh pool on two hosts, two ranks each, forked on every host by one engine forker.

Each host runs one forker, started by one ssh command from the kernel, which imported
torch once and forks that host's engines with their nannies. The forkers outlive a
rank's death and a restart (a recovery forks the new group from them); ``stop()`` ends
them, and each removes the pool's snapshot root on its host. Every host has a
``/dev/shm`` of its own here (``private_shm``), so each host's root is checked where it is.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from fsdp_interactive.pool import Pool, RankDied
from tests.multihost.conftest import exists_on, left_on_hosts, wait_until
from tests.multihost.launchers import running_ssh_pool
from tests.multihost.testhosts import HostSet

pytestmark = pytest.mark.multihost

PER_HOST = 2
FORKER = "fsdp_interactive.pool.processes._engine_forker"
WRITE_SNAPSHOT = (
    "import os, socket\n"
    "folder = os.path.join(os.environ['FSDPI_SNAPSHOT_ROOT'], 's000001')\n"
    "os.makedirs(folder, exist_ok=True)\n"
    "open(os.path.join(folder, f'rank{rank}-{socket.gethostname()}'), 'w').close()\n"
)


@pytest.fixture(scope="module")
def pool(private_shm, tmp_path_factory) -> Iterator[Pool]:
    profile_dir = str(tmp_path_factory.mktemp("forkers-profile"))
    with running_ssh_pool(private_shm, PER_HOST, profile_dir) as pool:
        yield pool


def forkers_by_host(pool: Pool) -> dict[str, int]:
    """``host -> pid`` of the process the host's ranks were forked from (one per host)."""
    parents: dict[str, set[int]] = {}
    for record in pool.topology:
        parents.setdefault(record.host, set()).add(psutil.Process(record.pid).ppid())
    assert all(len(pids) == 1 for pids in parents.values()), parents
    return {host: pids.pop() for host, pids in parents.items()}


def marker(pool: Pool, rank: int, host: str) -> str:
    return f"{pool.snapshot_root}/s000001/rank{rank}-{host}"


def test_each_host_forks_its_ranks_from_one_forker_reached_by_one_ssh(pool, testhosts):
    assert [(r.host, r.local_rank) for r in pool.topology] == [
        ("hosta", 0),
        ("hosta", 1),
        ("hostb", 0),
        ("hostb", 1),
    ]
    forkers = forkers_by_host(pool)
    for host, pid in forkers.items():
        command = " ".join(psutil.Process(pid).cmdline())
        assert FORKER in command and pool.snapshot_root not in command  # it is on stdin
        assert pid in {p.pid for p in testhosts.processes_on(host)}  # it runs on that host
    ssh_clients = [
        p
        for p in psutil.Process().children()
        if p.name() == "ssh" and FORKER in " ".join(p.cmdline())
    ]
    assert sorted(p.cmdline()[-3] for p in ssh_clients) == ["hosta", "hostb"]
    assert {p.pid for p in ssh_clients} <= set(pool.launched_pids)  # the reaper ends them
    roots = pool.run("import os; os.environ['FSDPI_SNAPSHOT_ROOT']", stream=False).results
    assert set(roots.values()) == {repr(pool.snapshot_root)}


def test_a_killed_rank_leaves_every_forker_and_root_and_the_next_group_forks_from_them(
    pool, testhosts
):
    forkers = forkers_by_host(pool)
    pool.run(WRITE_SNAPSHOT, stream=False)
    victim = pool.topology[3]
    assert victim.host == "hostb"
    old = [(r.host, r.pid) for r in pool.topology]
    threading.Timer(2.0, testhosts.run, ("hostb", ["kill", "-KILL", str(victim.pid)])).start()
    with pytest.raises(RankDied) as died:
        pool.run(
            "import os, time\n"
            "os.write(2, f'rank {rank} waiting\\n'.encode())\n"
            "while True:\n"
            "    time.sleep(0.05)",
            stream=False,
        )
    error = died.value
    assert error.exit_codes[3] == -signal.SIGKILL, error.exit_codes
    assert "rank 3 waiting" in error.log_tails[3], error.log_tails

    # The broken group's engines go; the forkers stay, and so do the roots.
    def old_engines_running() -> bool:
        return any(pid in {p.pid for p in testhosts.processes_on(h)} for h, pid in old)

    assert wait_until(lambda: not old_engines_running(), 60)
    running_on = {h.name: {p.pid for p in testhosts.processes_on(h.name)} for h in testhosts.hosts}
    assert pool.state == "broken"
    for host, pid in forkers.items():
        assert pid in running_on[host] and psutil.Process(pid).is_running()
    for rank, host in ((0, "hosta"), (3, "hostb")):
        assert exists_on(testhosts, host, marker(pool, rank, host))
    # Each host holds its own ranks' files only: the roots are per host.
    assert not exists_on(testhosts, "hosta", marker(pool, 3, "hostb"))
    began = time.monotonic()
    pool.restart()
    print(f"restart from the kept forkers: {time.monotonic() - began:.1f}s")  # shown with -s
    assert forkers_by_host(pool) == forkers
    result = pool.run("t = torch.ones(1); dist.all_reduce(t); t.item()", stream=False).results
    assert set(result.values()) == {"4.0"}


def test_stop_ends_the_forkers_and_removes_the_root_on_every_host(pool, testhosts: HostSet):
    pool.run(WRITE_SNAPSHOT, stream=False)
    forkers = forkers_by_host(pool)
    for record in pool.topology:
        assert exists_on(testhosts, record.host, marker(pool, record.rank, record.host))
    pool.stop()
    assert left_on_hosts(testhosts) == {}
    for host in forkers:
        assert not exists_on(testhosts, host, pool.snapshot_root)
