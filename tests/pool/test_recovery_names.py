"""Names a recovery can find, on a real 2-rank pool: ``snapshot()`` records the attribute
path it is given (not an alias a ``--no-replay`` cell made), re-points or refuses a
variable a recovery would not bind again, the dry run lists every journal entry with its
decision, and a recovery to a snapshot whose objects no replayed call binds is refused
before anything ends, with advice that works when followed."""

from __future__ import annotations

import pytest

from fsdp_interactive.pool import RankError
from fsdp_interactive.pool.errors import RecoveryError
from tests.pool.recovery_cells import kill_rank_1, values

BUILD = """
import torch, warnings
from types import SimpleNamespace
import fsdp_interactive
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy
from fsdp_interactive.examples import TinyTransformer, TransformerBlock, synthetic_batch
torch.manual_seed(0)
run = SimpleNamespace()
run.model = FSDP(TinyTransformer(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
run.optim = torch.optim.AdamW(run.model.parameters(), lr=3e-3)
"""
STEP = """
x, y = synthetic_batch(0, rank)
torch.nn.functional.cross_entropy(run.model(x).flatten(0, 1), y.flatten()).backward()
run.optim.step()
run.optim.zero_grad()
"""
WEIGHTS = "[p.to_local().sum().item() for p in run.model.parameters()]"


def test_the_path_given_is_recorded_and_an_alias_is_repointed_or_refused(pool, capsys):
    pool.restart()
    pool.run(BUILD, cell=1, stream=False)
    pool.run("m = run.model\no = run.optim", cell=2, stream=False, replay=False)
    pool.run(STEP, cell=3, stream=False, replay=False)
    taken = "fsdp_interactive.snapshot(model=run.model, optimizer=run.optim, step=1).names"
    names = values(pool, taken)  # not journaled: no call to judge
    assert names[0] == {"model": "run.model", "optimizer": "run.optim", "stateful": {}}
    # Given the aliases, in a notebook call: re-pointed where the build cell keeps them.
    with_aliases = (
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    names = fsdp_interactive.snapshot(model=m, optimizer=o, step=1).names\n"
        "print(names)\nprint(*[str(w.message) for w in caught], sep='\\n')"
    )
    out = pool.run(with_aliases, cell=4, stream=False).stdout[0]
    assert "{'model': 'run.model', 'optimizer': 'run.optim', 'stateful': {}}" in out
    assert (
        "'model' is recorded at run.model, not m: only In[2] binds it, and In[2] is "
        "marked --no-replay" in out
    )
    # An object only a --no-replay cell holds: refused, nothing written.
    pool.run("lonely = FSDP(torch.nn.Linear(4, 4))", cell=5, stream=False, replay=False)
    before = [s.id for s in pool.snapshots()]
    with pytest.raises(RankError) as refused:
        pool.run("fsdp_interactive.snapshot(model=lonely)", cell=6, stream=False)
    kind, message = refused.value.errors[0]
    assert kind == "SnapshotObjectsError"
    assert "model=lonely: only In[5] binds it, and In[5] is marked --no-replay" in message
    assert "nothing was written" in message and [s.id for s in pool.snapshots()] == before
    # Bound in the cell that takes it: a recovery would not replay that cell.
    with pytest.raises(RankError) as refused:
        pool.run(
            "fresh = FSDP(torch.nn.Linear(4, 4))\nfsdp_interactive.snapshot(model=fresh)",
            cell=7,
            stream=False,
        )
    assert (
        "In[7] binds 'fresh', and a recovery replays only the calls before"
        in (refused.value.errors[0][1])
    )

    saved = values(pool, WEIGHTS)
    pool.run(STEP, cell=8, stream=False, replay=False)  # past the snapshot
    kill_rank_1(pool, cell=9)
    capsys.readouterr()
    plan = pool.recover(dry_run=True)
    shown = capsys.readouterr().out
    assert [e.cell for e in plan.replay] == [1]
    for line in (
        "  In[1] defines run\n",
        "  In[2] skipped: marked %%fsdp --no-replay",
        "  In[3] skipped: marked %%fsdp --no-replay",
        "  In[4] skipped: took the snapshot, which holds what it did until then",
        "  In[6] skipped: ended with error",
        "  In[8] skipped: ran after the snapshot was taken: run it again after the recovery",
        "  In[9] skipped: ended with died",
    ):
        assert line in shown, (line, shown)
    report = pool.recover()
    assert values(pool, WEIGHTS) == saved
    lost = {n.name: n.how for n in report.lost}
    assert lost["m"] == "In[2] defines it and is marked --no-replay: run In[2] again"


def test_a_snapshot_no_replay_can_restore_is_refused_before_anything_ends(pool, capsys):
    """Taken outside a notebook call (nothing judges it then) of an object only a
    --no-replay cell binds: the recovery refuses before it ends the group, keeping every
    variable, and its advice (the older snapshot) works when followed."""
    pool.restart()
    pool.run(BUILD, cell=1, stream=False)
    pool.run("fsdp_interactive.snapshot(model=run.model, optimizer=run.optim, step=1)", cell=2)
    older = pool.snapshots()[-1].id
    saved = values(pool, WEIGHTS)
    pool.run("lonely = FSDP(torch.nn.Linear(4, 4))", cell=3, stream=False, replay=False)
    pool.run("fsdp_interactive.snapshot(model=lonely)", stream=False, journal=False)
    newest = pool.snapshots()[-1]
    assert newest.names["model"] == "lonely" and newest.id != older
    pool.run("marker = 7", cell=4, stream=False)
    pids = [r.pid for r in pool.topology]
    for dry_run in (True, False):
        with pytest.raises(RecoveryError) as refused:
            pool.recover(dry_run=dry_run)
        message = str(refused.value)
        assert f"snapshot {newest.id}" in message and "cannot be recovered to" in message
        assert "'lonely' (the model): only In[3] binds it, and In[3] is marked --no-replay" in (
            message
        )
        assert "nothing was changed" in message
        assert (
            f"the older snapshot {older} (of run.model, run.optim) with "
            f"pool.recover('{older}')" in message
        )
        assert f"%fsdp recover --from {older}" in refused.value.notebook_message()
    shown = capsys.readouterr().out
    assert "  In[3] skipped: marked %%fsdp --no-replay" in shown and "ran before" not in shown
    assert [r.pid for r in pool.topology] == pids
    assert values(pool, "marker") == {0: 7, 1: 7}
    # Followed: back to the older snapshot.
    pool.run(STEP, cell=5, stream=False, replay=False)
    report = pool.recover(older)
    assert report.snapshot.id == older and values(pool, WEIGHTS) == saved
