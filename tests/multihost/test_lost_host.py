"""A lost host is recovered from: an ssh pool on two hosts, two ranks each, loses ``hostb``.

The model and optimizer are built by journaled cells, trained, snapshotted (every rank's
shards in its host's ``/dev/shm``, and a copy of each on the other host) and trained one
more step. Then ``hostb`` goes as a host does: its engine forker and every rank on it
are killed with SIGKILL, and its ``/dev/shm`` is emptied. The next call raises
``RankDied`` naming ``hostb`` as lost; ``recover()`` leaves that host out, starts two
ranks on ``hosta`` alone, replays the cells and restores the snapshot from ``hosta``'s
copies, resharded from four ranks to two: the full (gathered) parameters and optimizer
state are bit for bit those at the snapshot, and each rank's random state is the one
saved for its rank. Training then goes on, and ``stop()`` leaves no process and no
snapshot root on either host. Every simulated host has a ``/dev/shm`` of its own.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
from collections.abc import Iterator

import psutil
import pytest

from fsdp_interactive.pool import Pool, RankDied
from tests.multihost.conftest import exists_on, left_on_hosts, wait_until
from tests.multihost.launchers import running_ssh_pool
from tests.multihost.testhosts import HostSet
from tests.pool.recovery_cells import SETUP

pytestmark = [pytest.mark.multihost, pytest.mark.timing]

PER_HOST = 2
LOST = "hostb"
SNAPSHOT_STEP = 2

#: Training steps and fingerprints, run by every rank. ``full_fingerprint`` gathers every
#: parameter and optimizer state tensor to its full value first (collective): the world
#: size changes across the recovery, so only the full state can be compared.
HELPERS = """
import hashlib
import fsdp_interactive
from fsdp_interactive.examples import synthetic_batch

def train(first, steps):
    for step in range(first, first + steps):
        x, y = synthetic_batch(step, rank)
        torch.rand(1 + rank)  # random draws, as dropout makes: each rank's stream differs
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
    return first + steps

def _add(digest, name, value):
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    digest.update(name.encode())
    if isinstance(value, torch.Tensor):
        digest.update(f"{value.dtype} {tuple(value.shape)}".encode())
        digest.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    else:
        digest.update(repr(value).encode())

def full_fingerprint():
    digest = hashlib.sha256()
    params = dict(model.named_parameters())
    for name in sorted(params):
        _add(digest, name, params[name])
    for name in sorted(params):
        for key, value in sorted(optim.state.get(params[name], {}).items()):
            _add(digest, f"{name}:{key}", value)
    for index, group in enumerate(optim.param_groups):
        for key in sorted(k for k in group if k != "params"):
            _add(digest, f"group {index}:{key}", group[key])
    return digest.hexdigest()

def rng_fingerprint():
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
"""


@pytest.fixture
def pool(testhosts: HostSet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """A started ssh pool, ``PER_HOST`` ranks on each host; stopped also on failure."""
    profile_dir = str(tmp_path_factory.mktemp("lost-host-profile"))
    with running_ssh_pool(testhosts, PER_HOST, profile_dir) as pool:
        yield pool


def per_rank(pool: Pool, expression: str) -> dict[int, str]:
    """The value of ``expression`` (a string) on every rank, by rank; not journaled."""
    results = pool.run(expression, stream=False, journal=False).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


def full_state(pool: Pool) -> str:
    """The fingerprint of the full model and optimizer state, the same on every rank."""
    found = set(per_rank(pool, "full_fingerprint()").values())
    assert len(found) == 1, found  # every rank gathered the same full state
    return found.pop()


def lose_host(hosts: HostSet, pool: Pool, host: str) -> list[int]:
    """End ``host`` as a host failure would: SIGKILL its engine forker first (so that no
    exit status of its ranks is reported, as none would be from a host that is gone),
    then every process it forked (the ranks and their nannies), by pid; empty its
    ``/dev/shm``. The pids killed."""
    ranks = [record.pid for record in pool.topology if record.host == host]
    forkers = {psutil.Process(pid).ppid() for pid in ranks}
    assert len(forkers) == 1, forkers
    forker = psutil.Process(forkers.pop())
    assert forker.pid in {p.pid for p in hosts.processes_on(host)}  # it runs on that host
    children = [child.pid for child in forker.children(recursive=True)]
    assert set(ranks) <= set(children)
    killed = [forker.pid, *children]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not any(psutil.pid_exists(pid) for pid in killed), 30)
    # A forker killed with SIGKILL cannot remove its snapshot root; the host's memory,
    # which held it, is gone with the host.
    assert exists_on(hosts, host, pool.snapshot_root)
    hosts.run(host, ["rm", "-rf", "--", pool.snapshot_root])
    return killed


def test_a_lost_host_is_recovered_from_on_the_remaining_host_bit_for_bit(
    pool: Pool, testhosts: HostSet
) -> None:
    hosts = testhosts
    assert [r.host for r in pool.topology] == ["hosta", "hosta", "hostb", "hostb"]
    pool.run(SETUP, cell=1, stream=False)
    pool.run(HELPERS, cell=2, stream=False)
    pool.run(f"train(0, {SNAPSHOT_STEP})", cell=3, stream=False, replay=False)
    at_snapshot = full_state(pool)
    rng_at_snapshot = per_rank(pool, "rng_fingerprint()")
    assert len(set(rng_at_snapshot.values())) == 2 * PER_HOST  # one stream per rank
    pool.run(
        f"fsdp_interactive.snapshot(model=model, optimizer=optim, step={SNAPSHOT_STEP})",
        cell=4,
        stream=False,
        replay=False,
    )
    (snapshot,) = pool.snapshots()
    assert snapshot.step == SNAPSHOT_STEP and snapshot.hosts == ("hosta", "hosta", LOST, LOST)
    # Each host holds every rank's file: its own ranks' and the other host's copies.
    for host in ("hosta", LOST):
        for rank in range(2 * PER_HOST):
            path = f"{pool.snapshot_root}/{snapshot.id}/__{rank}_0.distcp"
            assert exists_on(hosts, host, path), (host, path)
    pool.run(f"train({SNAPSHOT_STEP}, 1)", cell=5, stream=False, replay=False)
    assert full_state(pool) != at_snapshot  # the step after the snapshot changed the state

    lose_host(hosts, pool, LOST)
    with pytest.raises(RankDied) as died:
        pool.run("rank", stream=False, journal=False)
    assert died.value.lost_hosts == [LOST], died.value
    assert died.value.ranks == [2, 3]
    assert f"host {LOST} lost" in str(died.value)

    plan = pool.recover(dry_run=True)
    assert plan.dropped_hosts == (LOST,) and plan.world_size is None
    assert [e.cell for e in plan.replay] == [1, 2]  # the setup cells; not the training
    report = pool.recover()
    assert report.world_size == 2 and report.snapshot.step == SNAPSHOT_STEP
    assert [(r.host, r.local_rank) for r in pool.topology] == [("hosta", 0), ("hosta", 1)]
    restored = report.restored
    assert (restored["saved_world_size"], restored["world_size"]) == (2 * PER_HOST, 2)
    assert restored["copied_files"] == 0  # hosta's own files and copies held it all
    assert full_state(pool) == at_snapshot
    # Rank r continues with the random state saved for rank r.
    assert per_rank(pool, "rng_fingerprint()") == {r: rng_at_snapshot[r] for r in (0, 1)}

    # Training goes on, on the remaining host, from the snapshot's step.
    after = SNAPSHOT_STEP + 1
    assert per_rank(pool, f"train({SNAPSHOT_STEP}, 1)") == {0: after, 1: after}
    assert full_state(pool) != at_snapshot

    pool.stop()
    assert left_on_hosts(hosts) == {}
    for host in ("hosta", LOST):
        assert not exists_on(hosts, host, pool.snapshot_root)
