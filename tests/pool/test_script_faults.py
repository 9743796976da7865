"""A script run and the faults of a pool: a rank that dies while the script is paused, or
while it runs; what the pool says, and what ``recover()`` does (the run replayed to its
pause before the snapshot, the snapshot loaded, and the run continued to the same end as
an uninterrupted one, bit for bit); the recoveries it refuses, with the reason."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest

from fsdp_interactive.pool import Pool, RankDied, RecoveryError
from tests.torchrun_reference import differences

pytestmark = pytest.mark.timing

# Trains a small model; rank 1 kills itself once at step --die-at (a marker file says it
# did), as an OOM kill or a crashed node would end it.
DIES_ONCE = """
import argparse, os, signal
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--marker", default="")
    parser.add_argument("--save", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)),
                 device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(7 + rank)
    for step in range(args.steps):
        if step == args.die_at and rank == 1 and not os.path.exists(args.marker):
            open(args.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if args.save:
        from save_state import save_state
        save_state(args.save, rank, model, optimizer)

if __name__ == "__main__":
    main()
"""


def script(folder: Path) -> Path:
    path = folder / "dies_once.py"
    path.write_text(DIES_ONCE)
    (folder / "save_state.py").write_text(
        (Path(__file__).parents[1] / "torchrun_scripts" / "save_state.py").read_text()
    )
    return path


def snapshot(pool: Pool) -> None:
    pool.run(
        "import fsdp_interactive\nfsdp_interactive.snapshot(model=model, optimizer=optimizer)",
        stream=False,
    )


def test_rank_dies_while_paused_then_while_running_and_recover_replays_the_run(
    pool: Pool, tmp_path: Path
):
    pool.restart()  # an epoch of this test's own
    path, marker = script(tmp_path), tmp_path / "died"
    pool.run_script(path, ["--save", str(tmp_path / "uninterrupted")])  # the reference
    args = ["--die-at", "6", "--marker", str(marker), "--save", str(tmp_path / "recovered")]

    # paused after step 3, continued to step 5, snapshot; rank 1 killed between calls
    assert pool.run_script(path, args, stop_at=3).steps == 3
    assert pool.continue_script(stop_at=5).steps == 5
    snapshot(pool)
    os.kill(pool.topology[1].pid, signal.SIGKILL)
    with pytest.raises(RankDied, match=r"rank 1 .* died") as died:
        pool.script_status()
    assert "pool.recover()" in str(died.value)
    plan = str(pool.recover(dry_run=True))
    assert "replay 2 calls" in plan
    assert "runs dies_once.py" in plan and "to its pause after step 3" in plan
    assert "continues dies_once.py" in plan and "after step 5" in plan
    report = pool.recover()
    assert len(report.replayed) == 2
    status = pool.script_status()
    assert status.paused and status.steps == 5  # the run is back at its pause, frames alive

    # continued: rank 1 dies at step 6 while the script runs
    with pytest.raises(RankDied, match="rank 1"):
        pool.continue_script()
    assert marker.exists() and pool.state == "broken"
    report = pool.recover()  # to the same snapshot: the run replayed to step 5 again
    assert pool.script_status().steps == 5
    status = pool.continue_script()
    assert status.state == "ended" and status.steps == 8
    assert differences(tmp_path / "uninterrupted", tmp_path / "recovered", 2) == []


def test_recoveries_a_script_run_cannot_reach_are_refused_with_the_reason(
    pool: Pool, tmp_path: Path
):
    pool.restart()
    path = script(tmp_path)
    pool.run_script(path, stop_at=2)
    snapshot(pool)
    with pytest.raises(RecoveryError, match="ran on 2 ranks; run again on 1 ranks") as refused:
        pool.recover(world=1, dry_run=True)
    assert "nothing was changed" in str(refused.value)
    pool.continue_script(stop=True)

    # a snapshot the script takes itself, while it runs: no replay can stop there
    itself = tmp_path / "snapshots_itself.py"
    itself.write_text(
        textwrap.dedent(
            """
            import torch, fsdp_interactive
            model = torch.nn.Linear(4, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(4):
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()
                if step == 1:
                    fsdp_interactive.snapshot(model=model, optimizer=optimizer)
            """
        )
    )
    pool.run_script(itself)
    with pytest.raises(RecoveryError, match=r"taken by the script snapshots_itself\.py itself"):
        pool.recover(dry_run=True)
    assert pool.running  # nothing was touched
