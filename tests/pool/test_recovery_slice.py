"""The slice a recovery replays, on a real 2-rank pool: the notebook of a user who builds,
trains, saves, loads and snapshots (no ``--no-replay`` anywhere) recovers by replaying the
build cell alone, bit for bit; a hook registered behind the code's back and a cell forced
with ``replay=True`` are replayed; replayed cells draw the original's random numbers; and
objects kept in attributes are found again, or the recovery fails naming them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fsdp_interactive.pool import Pool, RankError
from fsdp_interactive.pool.errors import RecoveryError
from tests.pool.recovery_cells import helpers, kill_rank_1, values

BUILD = """
import torch
import fsdp_interactive
from fsdp_interactive import checkpoint
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy
from fsdp_interactive.examples import TinyTransformer, TransformerBlock, synthetic_batch
torch.manual_seed(0)
model = FSDP(TinyTransformer(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
"""
TRAIN = """
for step in range({first}, {last}):
    x, y = synthetic_batch(step, rank)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
print(f"loss {{loss.item():.4f}}")
"""


@pytest.fixture
def fresh(pool: Pool, tmp_path: Path) -> tuple[Pool, Path]:
    """The shared pool on a fresh group: a journal epoch of its own."""
    pool.restart()
    return pool, tmp_path


def test_the_notebook_recovers_by_replaying_the_build_cell_alone(fresh, capsys):
    pool, tmp_path = fresh
    root = tmp_path / "ckpt"
    # fingerprint() (of recovery_cells.helpers) is defined in the build cell.
    pool.run(BUILD + helpers(str(tmp_path)), cell=1, stream=False)
    pool.run(TRAIN.format(first=0, last=2), cell=2, stream=False)
    save = f"checkpoint.save({str(root)!r} + '/step-3', model, optim, step=2)"
    pool.run(save, cell=3, stream=False)
    pool.run(f"checkpoint.load({str(root)!r} + '/step-3', model, optim)", cell=4, stream=False)
    pool.run("fsdp_interactive.snapshot(model=model, optimizer=optim, step=2)", cell=5)
    saved = values(pool, "fingerprint()")
    pool.run(TRAIN.format(first=2, last=3), cell=6, stream=False)  # past the snapshot
    kill_rank_1(pool, cell=7)
    capsys.readouterr()

    plan = pool.recover(dry_run=True)
    shown = capsys.readouterr().out
    assert [e.cell for e in plan.replay] == [1]
    assert "  In[1] defines model, optim" in shown
    for cell in (2, 3, 4):
        assert f"  In[{cell}] skipped: uses model, optim, whose state the snapshot holds" in shown

    report = pool.recover()
    assert [e.cell for e in report.replayed] == [1]
    assert values(pool, "fingerprint()") == saved
    # Building the model drew no initial weights: the snapshot overwrote them.
    assert report.replay_outcome.skipped_inits > 0 and report.replay_outcome.run_inits == 0
    assert "parameter initializations skipped" in capsys.readouterr().out
    # Training goes on, and a second fault recovers the same way.
    pool.run(TRAIN.format(first=2, last=3), cell=8, stream=False)
    kill_rank_1(pool, cell=9)
    again = pool.recover()
    assert [e.cell for e in again.replayed] == [1] and values(pool, "fingerprint()") == saved


def test_hooks_made_behind_the_codes_back_and_forced_cells_are_replayed(fresh):
    pool, _ = fresh
    pool.run(BUILD, cell=1, stream=False)
    pool.run(
        "calls = []\n"
        "def attach(module):\n"
        "    module.register_forward_hook(lambda m, args, out: calls.append(1))\n",
        cell=2,
        stream=False,
    )
    pool.run("attach(model)", cell=3, stream=False)  # the code does not say it reshapes model
    pool.run(
        "seen = []\n"
        "torch.nn.modules.module.register_module_forward_pre_hook("
        "lambda m, args: seen.append(1) if m is model else None)",
        cell=4,
        stream=False,
        replay=True,  # a global hook: nothing the slice can see (%%fsdp --replay)
    )
    pool.run(TRAIN.format(first=0, last=1), cell=5, stream=False)
    pool.run("fsdp_interactive.snapshot(model=model, optimizer=optim)", cell=6, stream=False)
    kill_rank_1(pool, cell=7)
    plan = pool.recover(dry_run=True)
    lines = "\n".join(plan.lines())
    assert "In[3] changes model (its hooks (0 -> 1), seen after it ran)" in lines
    assert "In[4] forced by %%fsdp --replay" in lines
    assert "In[5] skipped: uses model, optim" in lines
    report = pool.recover()
    assert [e.cell for e in report.replayed] == [1, 2, 3, 4]
    try:
        pool.run("calls.clear(); seen.clear()\nmodel(synthetic_batch(0, rank)[0]); None")
        assert values(pool, "(len(calls), len(seen))") == {0: (1, 1), 1: (1, 1)}
    finally:
        pool.restart()  # the global hook must not outlive this test


def test_replayed_cells_draw_the_random_numbers_they_drew_first(fresh):
    pool, _ = fresh
    draw = (
        "import random, numpy\n"
        "noise = (torch.rand(3).tolist(), random.random(), float(numpy.random.rand()))\n"
    )
    seed = "import random, numpy\nrandom.seed(rank)\nnumpy.random.seed(7 + rank)"
    pool.run(seed, cell=1, stream=False)
    pool.run(draw, cell=2, stream=False)
    build = BUILD.replace("torch.manual_seed(0)\n", "") + "width = len(noise)"
    pool.run(build, cell=3, stream=False)
    pool.run(
        draw.replace("noise", "later") + "sched = torch.optim.lr_scheduler.StepLR(optim, 1)\n",
        cell=4,
        stream=False,
    )
    drawn = values(pool, "(noise, later)")
    assert drawn[0] != drawn[1]  # each rank its own streams
    snapshot = "fsdp_interactive.snapshot(model=model, optimizer=optim, sched=sched)"
    pool.run(snapshot, cell=5, stream=False)
    kill_rank_1(pool, cell=6)
    report = pool.recover()
    # The seeding cell is not needed: the journal kept the generators it left.
    assert [e.cell for e in report.replayed] == [2, 3, 4]
    # In[2] ran with its original generators; so did In[4], after In[3] whose
    # initialization was skipped.
    assert values(pool, "(noise, later)") == drawn


def test_background_snapshots_back_to_back_in_a_notebook_call(fresh):
    # Each snapshot checks that its objects can be found again, over the group the one
    # still writing in the background publishes on: the check waits for it.
    pool, _ = fresh
    pool.run(BUILD, cell=1, stream=False)
    take = (
        "handles = [fsdp_interactive.snapshot(model=model, optimizer=optim, step=step, "
        "background=True) for step in range(6)]\n"
        "[handle.wait().step for handle in handles]"
    )
    steps = pool.run(take, cell=2, stream=False).results  # a notebook call: checked
    assert {rank: ast.literal_eval(text) for rank, text in steps.items()} == {
        rank: [0, 1, 2, 3, 4, 5] for rank in (0, 1)
    }


def test_objects_in_attributes_are_recorded_there_and_found_again(fresh):
    pool, tmp_path = fresh
    box = "class Box:\n    pass\nbox = Box()\nbox.net, box.opt = model, optim\n"
    pool.run(BUILD + box, cell=1, stream=False)
    fingerprint = helpers(str(tmp_path)).replace("model.", "box.net.").replace("optim.", "box.opt.")
    pool.run(fingerprint, cell=2, stream=False)
    take = "fsdp_interactive.snapshot(model=box.net, optimizer=box.opt).names"
    # The path given is recorded, though variables hold the same objects.
    taken = values(pool, take)[0]
    assert taken == {"model": "box.net", "optimizer": "box.opt", "stateful": {}}
    # Given through a function's own names, the objects are searched for: a variable
    # is preferred to an attribute path.
    search = (
        "(lambda m, o: fsdp_interactive.snapshot(model=m, optimizer=o))(box.net, box.opt).names"
    )
    assert values(pool, search)[0] == {"model": "model", "optimizer": "optim", "stateful": {}}
    pool.run("del model, optim", cell=3, stream=False)
    taken = ast.literal_eval(pool.run(search, cell=4, stream=False).results[0])
    assert taken == {"model": "box.net", "optimizer": "box.opt", "stateful": {}}
    saved = values(pool, "fingerprint()")
    kill_rank_1(pool, cell=5)
    report = pool.recover()
    assert [e.cell for e in report.replayed] == [1, 2]
    assert report.restored["names"] == {"model": "box.net", "optimizer": "box.opt"}
    assert values(pool, "fingerprint()") == saved


def test_an_object_nobody_can_find_is_refused_when_the_snapshot_is_taken(fresh):
    pool, _ = fresh
    pool.run(BUILD, cell=1, stream=False)
    before = [s.id for s in pool.snapshots()]
    with pytest.raises(RankError) as refused:
        pool.run(
            "def keep():\n"
            "    local = FSDP(TinyTransformer())\n"
            "    return fsdp_interactive.snapshot(model=local, optimizer=optim)\n"
            "keep()",
            cell=2,
            stream=False,
        )
    assert set(refused.value.errors) == {0, 1}
    kind, message = refused.value.errors[0]
    assert kind == "SnapshotObjectsError"
    assert "'model' is neither a variable of the notebook's namespace" in message
    assert "Assign each to a variable" in message and "optimizer" not in message.split(":")[0]
    assert [s.id for s in pool.snapshots()] == before


def test_a_recovery_that_cannot_put_an_object_back_fails_naming_it(fresh):
    pool, _ = fresh
    # The optimizer is made inside a method the training cell calls, as a Hugging Face
    # Trainer makes it inside train().
    box = """
class Box:
    opt = None
    def train(self):
        if self.opt is None:
            self.opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x, y = synthetic_batch(0, rank)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        self.opt.step()
box = Box()
"""
    pool.run(BUILD.replace("optim = ", "unused = ") + box, cell=1, stream=False)
    pool.run("box.train()", cell=2, stream=False)
    pool.run("fsdp_interactive.snapshot(model=model, optimizer=box.opt)", cell=3, stream=False)
    assert pool.snapshots()[-1].names["optimizer"] == "box.opt"
    kill_rank_1(pool, cell=4)
    with pytest.raises(RecoveryError) as failed:
        pool.recover()
    message = str(failed.value)
    assert "did not put back every object" in message and "fresh, empty group" in message
    assert "'optimizer' was at box.opt, and box.opt is None or missing now" in message
    assert "trainer.create_optimizer()" in message
    assert pool.running
    assert values(pool, "'model' in globals()") == {0: False, 1: False}
