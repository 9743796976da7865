"""Fault injection: rank processes killed with SIGKILL at random moments, each followed by
``recover()``, on one real 2-rank pool.

The moments: the forward pass, the backward pass, the optimizer step, just before a
snapshot, while a background snapshot is written, and during a recovery itself (while it
replays the setup cells). After every recovery each rank's parameters, optimizer state and
random state are bit for bit those recorded when the last completed snapshot was taken,
and training goes on from its step. The moments are drawn from a seeded generator (the
seed is printed), so a failure can be replayed. When the pool stops, no process it
started and no snapshot file is left.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from fsdp_interactive.pool import Pool, RankDied
from fsdp_interactive.pool._recovery import RecoveryError
from tests.pool.conftest import record, wait_gone
from tests.pool.recovery_cells import SETUP, fingerprints, helpers, taken_at

#: SIGKILLs while training (each at a random step, rank and phase) ...
TRAINING_KILLS = 26
#: ... and while a recovery replays (each then recovered from again).
RECOVERY_KILLS = 5
PHASES = ("forward", "backward", "step", "snapshot", "writing")
EVERY = 2  # a snapshot every second step
SEED = int(os.environ.get("FSDPI_FAULT_SEED", "20261205"))

#: A setup cell that kills a rank while it is being replayed, once armed by a file.
REPLAY_KILLER = """
import os, signal
from fsdp_interactive import _notices
if _notices.replaying() and os.path.exists(ARMED) and rank == int(open(ARMED).read()):
    os.remove(ARMED)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_thirty_sigkills_each_recovered_bit_for_bit(profile_dir, tmp_path: Path):
    rng = random.Random(SEED)
    print(f"fault injection seed {SEED} (FSDPI_FAULT_SEED replays it)")
    armed = tmp_path / "armed"
    pool = Pool(2, devices="cpu", profile_dir=profile_dir, show_topology=False)
    kills = 0
    try:
        pool.start()
        pool.run(SETUP, cell=1, stream=False)
        pool.run(helpers(str(tmp_path)), cell=2, stream=False)
        # Forced into every replay (%%fsdp --replay): it defines nothing the snapshot needs.
        pool.run(f"ARMED = {str(armed)!r}\n" + REPLAY_KILLER, cell=3, stream=False, replay=True)
        pool.run(f"train(0, {EVERY}, every={EVERY})", cell=4, stream=False, replay=False)
        step = EVERY
        for round_ in range(TRAINING_KILLS):
            rank, phase = rng.randrange(2), rng.choice(PHASES)
            if phase in ("snapshot", "writing"):  # an iteration that ends with a snapshot
                at = step + EVERY * rng.randrange(2) + EVERY - 1
                expected = at + 1 - EVERY  # that snapshot never completed
            else:
                at = step + rng.randrange(2 * EVERY)
                expected = at // EVERY * EVERY  # the last one taken before the kill
            background = phase == "writing" or rng.random() < 0.5
            kill = (rank, at, phase)
            cell = 10 + round_
            with pytest.raises(RankDied):
                pool.run(
                    f"train({step}, {4 * EVERY}, every={EVERY}, kill={kill!r}, "
                    f"background={background})",
                    cell=cell,
                    stream=False,
                    replay=False,
                )
            kills += 1
            if round_ < RECOVERY_KILLS:
                armed.write_text(str(rng.randrange(2)))
                with pytest.raises(RecoveryError, match="replaying In\\[3\\] failed"):
                    pool.recover()
                kills += 1
                assert not armed.exists()
            report = pool.recover()
            restored = report.snapshot.step
            assert restored == expected, (
                f"round {round_}: killed rank {rank} at step {at} ({phase}); the last "
                f"completed snapshot was of step {expected}, recovered to {restored}"
            )
            assert fingerprints(pool) == taken_at(tmp_path, restored, 2), (
                f"round {round_}: killed rank {rank} at step {at} ({phase}); restored "
                f"step {restored}"
            )
            step = restored
        assert kills >= 30
        # Training goes on from the last snapshot after all that.
        pool.run(f"train({step}, {EVERY}, every={EVERY})", stream=False)
        assert fingerprints(pool) == taken_at(tmp_path, step + EVERY, 2)
    finally:
        record(pool)
        pool.stop()
    assert wait_gone(pool.launched_pids) == []
    assert not os.path.exists(pool.snapshot_root)
