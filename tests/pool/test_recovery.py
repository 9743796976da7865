"""``Pool.recover`` on a real 2-rank pool: back to the snapshot bit for bit after a death, a
wedged collective or at any time; what it refuses, leaving the pool as it was; automatic
recovery; and nothing left in host memory or running after ``stop()``."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from fsdp_interactive.checkpoint._format import _manifest, _prechecked
from fsdp_interactive.pool import Pool, RankDied, RankTimeout
from fsdp_interactive.pool._recovery import RecoveryError, RecoveryPlan
from tests.pool.conftest import record, run_script, wait_gone
from tests.pool.recovery_cells import SETUP, fingerprints, helpers, taken_at

KILL_RANK_1 = "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"


@pytest.fixture
def fresh(pool: Pool, tmp_path: Path) -> tuple[Pool, Path]:
    """The shared pool on a fresh group (a journal epoch of its own) with the model and the
    training helpers defined, and a folder for the recorded fingerprints."""
    pool.restart()
    pool.run(SETUP, cell=1, stream=False)
    pool.run(helpers(str(tmp_path)), cell=2, stream=False)
    return pool, tmp_path


def test_recover_without_a_snapshot_refuses_and_leaves_the_pool_as_it_was(fresh):
    pool, _ = fresh
    pids = [r.pid for r in pool.topology]
    pool._snapshot_book.clear()
    with pytest.raises(RecoveryError, match="no snapshot to recover to; nothing was changed"):
        pool.recover()
    with pytest.raises(RecoveryError, match="no snapshot 's999999'"):
        pool.recover("s999999")
    with pytest.raises(ValueError, match="world must be a number of ranks"):
        pool.recover(world=0)
    assert pool.running and [r.pid for r in pool.topology] == pids
    assert pool.run("'model' in globals()", stream=False).results == {0: "True", 1: "True"}


OTHER_MODEL_SNAPSHOT = """
import fsdp_interactive
from fsdp_interactive.checkpoint import persist_snapshot, save
save(PLAIN, model, optim)
kept, model = model, FSDP(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)))
persist_snapshot(fsdp_interactive.snapshot(model=model).id, OTHER)
model = kept
ghost = FSDP(torch.nn.Linear(4, 4))
persist_snapshot(fsdp_interactive.snapshot(model=ghost).id, OTHER + "-ghost")
del kept, ghost
"""


@pytest.mark.timing
def test_bad_recover_input_is_refused_before_anything_ends(fresh, tmp_path, capsys):
    """Every refusal leaves the pool exactly as it was: the same rank processes, every
    variable still there; the dry run refuses the same input. After a death, what only
    live ranks can check is refused by the recovery itself."""
    pool, _ = fresh
    plain, other = tmp_path / "plain", tmp_path / "other"
    pool.run(
        f"PLAIN, OTHER = {str(plain)!r}, {str(other)!r}\n" + OTHER_MODEL_SNAPSHOT, journal=False
    )
    pool.run("marker = 42", cell=4, stream=False)
    damaged = tmp_path / "damaged"
    shutil.copytree(other, damaged)
    (damaged / "snapshot.json").write_text("{ not json")
    (tmp_path / "empty").mkdir()
    held = pool.snapshots()[-1].id
    rotated = "s" + "9" * 6
    pool._snapshot_book.add([{"id": rotated, "step": 1}])  # known, but on no host
    pids = [r.pid for r in pool.topology]
    refusals = {
        str(tmp_path / "empty"): r"is not a checkpoint folder \(it holds no manifest.json\)",
        str(tmp_path / "missing"): "no checkpoint folder",
        str(plain): "is a checkpoint saved by checkpoint.save, not a snapshot",
        str(damaged): "snapshot record .* is damaged",
        str(other): "was taken of another model: the model has .* keys it lacks",
        rotated: f"snapshot {rotated} is not held by any host of the group",
    }
    for source, reason in refusals.items():
        for dry_run in (True, False):
            with pytest.raises(RecoveryError, match=reason) as refused:
                pool.recover(source, dry_run=dry_run)
            assert "nothing was changed" in str(refused.value)
            assert "strict=False" not in str(refused.value)
            assert pool.running and [r.pid for r in pool.topology] == pids, source
    assert pool.run("marker", stream=False, journal=False).results == {0: "42", 1: "42"}
    # A snapshot whose record in host memory is damaged is not listed by any host (each
    # model's snapshot is kept: damage every one).
    for name in os.listdir(pool.snapshot_root):
        if name.startswith("s"):
            (Path(pool.snapshot_root) / name / "snapshot.json").write_text("{ not json")
    with pytest.raises(RecoveryError, match="the hosts of the group hold no snapshot"):
        pool.recover(dry_run=True)
    with pytest.raises(RecoveryError, match=f"snapshot {held} is not held by any host"):
        pool.recover(held)
    assert pool.run("marker", stream=False, journal=False).results == {0: "42", 1: "42"}
    assert "trying" not in capsys.readouterr().out
    # With the ranks dead nothing live can be compared: the restore refuses it, in a
    # recovery's words, without a partial load it cannot offer or an older try.
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, stream=False)
    with pytest.raises(RecoveryError, match="no snapshot could be restored") as refused:
        pool.recover(str(other))
    message = str(refused.value) + capsys.readouterr().out
    assert "was taken of another model" in message and "strict=False" not in message
    assert "trying" not in message and pool.running
    # A snapshot of a variable no replayed cell defines: named, without advice it cannot take.
    with pytest.raises(RecoveryError, match="'ghost', which is not defined now") as refused:
        pool.recover(f"{other}-ghost")
    assert "objects=" not in str(refused.value)


@pytest.mark.timing
def test_after_a_death_the_state_is_the_snapshots_bit_for_bit(fresh, capsys):
    pool, truth = fresh
    pool.run("train(0, 6, every=3)", cell=3, stream=False, replay=False)
    # keep_last=1: step 3's is gone (snapshots of other objects, from earlier tests, stay).
    assert [s.step for s in pool.snapshots() if s.holding == "model, optim"] == [6]
    pool.run("train(6, 2, every=100)", cell=4, stream=False)  # past the snapshot
    with pytest.raises(RankDied) as died:
        pool.run(KILL_RANK_1, cell=5, stream=False)
    assert "pool.recover()" in str(died.value)
    plan = pool.recover(dry_run=True)
    assert isinstance(plan, RecoveryPlan) and not pool.running
    # The cells before the one that took the snapshot; cell 4 ran after it.
    assert [e.cell for e in plan.replay] == [1, 2]
    report = pool.recover()
    assert report.snapshot is not None and report.snapshot.step == 6
    assert [e.cell for e in report.replayed] == [1, 2]
    assert set(report.phases) == {"end", "start", "find", "replay", "restore"}
    assert fingerprints(pool) == taken_at(truth, 6, 2)
    out = capsys.readouterr().out
    assert "recovered to the snapshot" in out and "of step 6" in out and "replayed 2 calls" in out


def test_the_hosts_forker_prechecks_the_snapshot_a_recovery_restores(fresh):
    pool, truth = fresh
    pool.run("train(0, 2, every=2)", cell=3, stream=False, replay=False)
    time.sleep(_prechecked.SETTLED_S)  # the files settle: the precheck may record them
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, cell=4, stream=False)
    report = pool.recover()
    assert fingerprints(pool) == taken_at(truth, 2, 2)
    folder = Path(pool.snapshot_root) / report.snapshot.id
    manifest = _manifest.read_manifest(folder)
    # The forker's child hashes at idle priority: its record may come after the restore,
    # which then hashed every file itself (and took none from it).
    assert report.restored["prechecked_files"] in (0, len(manifest.files))
    deadline = time.monotonic() + 60
    while not _prechecked.prechecked(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    found = _prechecked.prechecked(folder)
    assert {n: e.digest for n, e in found.items()} == {
        n: r.digest for n, r in manifest.files.items()
    }


def test_recover_frees_a_wedged_collective(fresh):
    pool, truth = fresh
    pool.run("train(0, 2, every=2)", cell=3, stream=False, replay=False)
    wedge = "import time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(600)\n"
    with pytest.raises(RankTimeout):
        pool.run(wedge, cell=4, timeout=2, stream=False)
    assert pool.busy_ranks() == [0, 1]
    report = pool.recover()
    assert report.snapshot.step == 2 and pool.busy_ranks() == []
    assert fingerprints(pool) == taken_at(truth, 2, 2)
    assert pool.run("1 + 1", stream=False).results == {0: "2", 1: "2"}


def test_recover_at_any_time_goes_back_and_can_reshard_to_one_rank(fresh):
    pool, truth = fresh
    pool.run("train(0, 3, every=3)", cell=3, stream=False, replay=False)
    pool.run("train(3, 2, every=100)", cell=4, stream=False, replay=False)
    assert fingerprints(pool) != taken_at(truth, 3, 2)
    report = pool.recover()
    assert report.snapshot.step == 3 and fingerprints(pool) == taken_at(truth, 3, 2)
    try:
        report = pool.recover(world=1)
        assert pool.world_size == 1
        assert (report.restored["saved_world_size"], report.restored["world_size"]) == (2, 1)
        full = pool.run(
            "sum(p.full_tensor().double().sum().item() for p in model.parameters())",
            stream=False,
        )
        assert float(full.results[0]) != 0.0
    finally:
        from fsdp_interactive.pool._placement import Request

        pool._request = Request(2, "cpu", None)
        pool.restart()


def test_a_corrupt_snapshot_is_refused_and_the_one_before_is_used(fresh, capsys):
    pool, truth = fresh
    pool.run("train(0, 4, every=2)", cell=3, stream=False, replay=False)
    pool.run("fsdp_interactive.snapshot(model=model, optimizer=optim, step=40, keep_last=2)")
    newest = pool.snapshots()[-1]
    assert newest.step == 40
    folder = Path(pool.snapshot_root) / newest.id
    damaged = next(p for p in sorted(folder.glob("__*.distcp")))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    capsys.readouterr()
    report = pool.recover()
    assert report.refused and newest.id in report.refused[0]
    assert report.snapshot.step == 4
    assert f"trying the older snapshot {report.snapshot.id}" in capsys.readouterr().out
    assert fingerprints(pool) == taken_at(truth, 4, 2)


def test_a_replayed_cell_that_fails_stops_the_recovery_and_leaves_a_fresh_group(fresh, tmp_path):
    pool, _ = fresh
    flag = tmp_path / "fail-on-replay"
    pool.run(  # a cell the slice would leave out: forced in (%%fsdp --replay)
        f"import os\nif os.path.exists({str(flag)!r}):\n    raise RuntimeError('not again')\n",
        cell=3,
        stream=False,
        replay=True,
    )
    pool.run("train(0, 2, every=2)", cell=4, stream=False, replay=False)
    flag.write_text("")
    with pytest.raises(RecoveryError, match=r"(?s)replaying In\[3\] failed.*not again"):
        pool.recover()
    assert pool.running
    assert pool.run("'model' in globals()", stream=False).results == {0: "False", 1: "False"}


def test_automatic_recovery_says_what_it_restored_in_the_error(profile_dir, tmp_path):
    pool = Pool(2, devices="cpu", profile_dir=profile_dir, show_topology=False, recover="auto")
    try:
        pool.start()
        pool.run(SETUP, cell=1, stream=False)
        pool.run(helpers(str(tmp_path)), cell=2, stream=False)
        pool.run("train(0, 2, every=2)", cell=3, stream=False, replay=False)
        with pytest.raises(RankDied) as died:
            pool.run(KILL_RANK_1, cell=4, stream=False)
        message = died.value.notebook_message()
        assert "rank 1" in message and "killed by signal SIGKILL" in message
        assert "recovered to the snapshot" in message and "of step 2" in message
        assert "Run the cell again to go on from step 2, the snapshot's" in message
        assert "restored from s" in message and ": model (the model), optim (the optimizer)" in (
            message
        )
        assert pool.running and fingerprints(pool) == taken_at(tmp_path, 2, 2)
    finally:
        record(pool)
        pool.stop()
    assert not os.path.exists(pool.snapshot_root)
    assert wait_gone(pool.launched_pids) == []


KERNEL_SCRIPT = f"""
import json, sys
from fsdp_interactive.pool import Pool
pool = Pool(n=2, devices="cpu", profile_dir=sys.argv[1], show_topology=False).start()
pool.run({SETUP!r}, cell=1)
pool.run("import fsdp_interactive\\nfsdp_interactive.snapshot(model=model, optimizer=optim)")
known = [s.id for s in pool.snapshots()]
report = pool.recover()
pool.stop()
print(json.dumps({{"torch_in_kernel": "torch" in sys.modules, "known": known,
                  "replayed": [e.cell for e in report.replayed]}}))
"""


def test_snapshots_and_recovery_leave_torch_out_of_the_kernel(profile_dir):
    output = run_script(KERNEL_SCRIPT, profile_dir)
    report = json.loads(output.strip().splitlines()[-1])
    assert report == {"torch_in_kernel": False, "known": ["s000001"], "replayed": [1]}
