"""Fault injection between calls: ranks killed while no call runs (the OOM killer between
cells, a ``kill -9``), at random moments, on one real 2-rank pool, with and without
``recover="auto"``; and an engine forker killed while its host stays up.

Each round kills one rank or both (SIGKILL, or SIGSEGV: a crash), waits a random moment,
sometimes asks ``check()`` first (what ``%fsdp status`` does), then runs a cell. That cell
never runs: it raises ``RankDied`` naming each dead rank, its host and its signal (never an
ipyparallel error), advising a recovery only when a snapshot exists. Without ``auto`` the
test then recovers (or restarts, without a snapshot); with it, the same error says what
the pool restored by itself, its phases were printed as they passed, and the ranks hold
the snapshot bit for bit. The rounds are drawn from a seeded generator (the seed is
printed; ``FSDPI_FAULT_SEED`` replays it). When the pool stops, no process it started
and no snapshot file is left.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool import Pool, RankDied
from fsdp_interactive.pool.processes._pids import start_time
from tests.pool.conftest import record, wait_gone
from tests.pool.recovery_cells import SETUP, fingerprints, helpers, taken_at

ROUNDS = 10
SEED = int(os.environ.get("FSDPI_FAULT_SEED", "20261212"))
SIGNALS = {signal.SIGKILL: "SIGKILL", signal.SIGSEGV: "SIGSEGV"}


@pytest.fixture(scope="module")
def faulty(profile_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A pool of its own (its ranks and forker are killed), with the model and the
    training helpers defined; stopped at the end."""
    truth = tmp_path_factory.mktemp("truth")
    pool = Pool(2, devices="cpu", profile_dir=profile_dir, show_topology=False)
    try:
        pool.start()
        yield pool, truth
    finally:
        record(pool)
        pool.stop()


def set_up(pool: Pool, truth: Path) -> None:
    pool.run(SETUP, cell=1, stream=False)
    pool.run(helpers(str(truth)), cell=2, stream=False)


def kill(pool: Pool, ranks: list[int], sig: int) -> None:
    """Send ``sig`` to ``ranks`` and wait until their processes have ended, so that the
    death happened before the next call (a death during the call is another test's)."""
    pids = {pool.topology[rank].pid: start_time(pool.topology[rank].pid) for rank in ranks}
    for pid in pids:
        os.kill(pid, sig)
    assert wait_gone(pids, timeout=30) == []


def test_ranks_killed_between_calls_are_reported_and_recovered(faulty, capsys):
    pool, truth = faulty
    rng = random.Random(SEED)
    print(f"fault injection seed {SEED} (FSDPI_FAULT_SEED replays it)")
    set_up(pool, truth)
    step, snapshot = 0, None
    outcomes = {"auto": 0, "manual": 0, "no snapshot": 0}
    for round_ in range(ROUNDS):
        auto = round_ % 2 == 1
        pool.recover_mode = "auto" if auto else None
        if round_ >= 2:  # the first two rounds come before the pool's first snapshot
            pool.run(f"train({step}, 2, every=2)", cell=10 + round_, stream=False, replay=False)
            step, snapshot = step + 2, step + 2
        ranks = rng.choice([[0], [1], [0, 1]])
        sig = rng.choice(list(SIGNALS))
        host = pool.topology[0].host
        kill(pool, ranks, sig)
        time.sleep(rng.uniform(0.0, 0.8))
        if rng.random() < 0.5:  # %fsdp status between the death and the next cell
            health = pool.check()
            assert health.death is not None and health.unreported, f"round {round_}"
            assert pool.state == "broken"
        capsys.readouterr()
        with pytest.raises(RankDied) as died:
            pool.run("ran = True", cell=50 + round_, stream=False)
        error = died.value
        message = error.notebook_message()
        shown = capsys.readouterr().out
        context = f"round {round_}: killed ranks {ranks} with {SIGNALS[sig]}, auto={auto}"
        assert error.between_calls and error.ranks == ranks, context
        for rank in ranks:
            assert f"rank {rank} (pid" in message and f"on {host})" in message, context
        assert f"killed by signal {SIGNALS[sig]}" in message, context
        assert "This call did not run." in message, context
        assert "No such engine" not in message and "IndexError" not in message, context
        if snapshot is None:
            # Nothing to go back to: only what works is advised, and nothing was tried.
            assert "%fsdp recover" not in message and "%fsdp restart" in message, context
            assert "Automatic recovery failed" not in message, context
            outcomes["no snapshot"] += 1
            pool.restart()
            set_up(pool, truth)
            continue
        if auto:
            assert "recovered to the snapshot" in message and f"of step {snapshot}" in message
            assert f"Run the cell again to go on from step {snapshot}, the snapshot's" in (
                message
            ), context
            # The phases were printed while it recovered, as a manual recovery prints them.
            assert "recovering to the last snapshot by itself" in shown, context
            assert "recovery: a fresh group of 2 ranks is up" in shown, context
            assert "recovery: replayed In[1]" in shown, context
            outcomes["auto"] += 1
        else:
            assert "%fsdp recover" in message and pool.state == "broken", context
            report = pool.recover()
            assert report.snapshot.step == snapshot, context
            outcomes["manual"] += 1
        assert pool.running and fingerprints(pool) == taken_at(truth, snapshot, 2), context
        # The call that found the death never ran, on the old group or the new one.
        ran = pool.run("'ran' in globals()", stream=False, journal=False).results
        assert ran == {0: "False", 1: "False"}, context
        step = snapshot
    print(f"between-call deaths: {outcomes}")
    assert sum(outcomes.values()) == ROUNDS >= 10
    assert all(outcomes.values()), outcomes


def test_an_engine_forker_killed_with_its_host_up_is_replaced_and_stop_leaves_nothing(
    faulty, capsys
):
    pool, truth = faulty
    if not pool.running:
        pool.restart()
    pool.recover_mode = None
    set_up(pool, truth)
    pool.run("train(0, 2, every=2)", cell=3, stream=False, replay=False)
    [forker] = pool._processes.forkers.forkers()
    ranks = [record.pid for record in pool.topology]
    os.kill(forker.pid, signal.SIGKILL)
    time.sleep(0.5)
    health = pool.check()  # what %fsdp status shows
    assert health.state == "running" and len(health.forker_deaths) == 1
    assert f"(pid {forker.pid}) ended (killed by signal SIGKILL)" in health.forker_deaths[0]
    capsys.readouterr()
    # The ranks it forked run on: the next cell runs, and says what happened once.
    assert pool.run("rank * 10", stream=False).results == {0: "0", 1: "10"}
    assert "the engine forker on this host" in capsys.readouterr().err
    assert pool.run("rank", stream=False).results == {0: "0", 1: "1"}
    assert "engine forker" not in capsys.readouterr().err
    assert [record.pid for record in pool.topology] == ranks
    [replacement] = pool._processes.forkers.forkers()
    assert replacement.pid != forker.pid and replacement.running()
    assert replacement.pid in pool.launched_pids
    # A rank that dies now is reported as ever; a recovery forks from the new forker.
    kill(pool, [1], signal.SIGKILL)
    with pytest.raises(RankDied) as died:
        pool.run("1", stream=False)
    assert "rank 1 (pid" in str(died.value) and died.value.between_calls
    pool.recover()
    assert fingerprints(pool) == taken_at(truth, 2, 2)
    new_ranks = {record.pid for record in pool.topology}
    assert {child.pid for child in psutil.Process(replacement.pid).children()} >= new_ranks
    record(pool)
    pool.stop()
    assert wait_gone(pool.launched_pids) == []
    assert not os.path.exists(pool.snapshot_root)
