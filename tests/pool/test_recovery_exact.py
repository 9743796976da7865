"""A recovery brings back exactly what it says, on a real pool: a model built in a replayed
cell but not held by the snapshot comes back equal to what the cell built, bit for bit
(this package's ``FullyShardedDataParallel`` and torch's ``fully_shard``, at 2 ranks and
at 4), the snapshot's own objects come back as the snapshot has them, and the report says
what was restored, what the replay rebuilt and which names are lost (with the cell that
defined each and how to get it back)."""

from __future__ import annotations

import io

import pytest

from fsdp_interactive.pool import Pool, RankDied
from tests.pool.conftest import record
from tests.pool.recovery_cells import KILL_RANK_1, values

#: One cell builds two sharded models the snapshot does not hold (``a`` with this package's
#: FSDP, ``b`` with ``fully_shard``), then the small model it holds.
BUILD = """
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy
from fsdp_interactive.examples import TinyTransformer, TransformerBlock
import fsdp_interactive
torch.manual_seed(0)
a = FSDP(TinyTransformer(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
b = TinyTransformer()
for block in b.blocks:
    fully_shard(block)
fully_shard(b)
c = nn.Linear(8, 8)
opt_c = torch.optim.SGD(c.parameters(), lr=0.1)
"""

FINGERPRINT = """
import hashlib
def fingerprint(module):
    digest = hashlib.sha256()
    for name, tensor in sorted([*module.named_parameters(), *module.named_buffers()]):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        digest.update(name.encode())
        digest.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
"""

#: A step on ``c`` only, so the snapshot's state differs from what the build cell drew.
STEP_C = "c(torch.ones(2, 8)).sum().backward()\nopt_c.step()\nopt_c.zero_grad()"

STATE = "{name: fingerprint(globals()[name]) for name in ('a', 'b', 'c')}"


def recover_the_model_the_snapshot_does_not_hold(pool: Pool) -> None:
    """Build, step, snapshot ``c``, take the state, kill rank 1, recover: ``a`` and ``b``
    (not in the snapshot) are what the build cell made, ``c`` what the snapshot holds."""
    pool.run(BUILD + FINGERPRINT, cell=1, stream=False)
    built = values(pool, STATE)
    pool.run(STEP_C, cell=2, stream=False)
    pool.run("snap = fsdp_interactive.snapshot(model=c, optimizer=opt_c, step=1)", cell=3)
    taken = values(pool, STATE)
    assert all(taken[r]["c"] != built[r]["c"] for r in taken)  # the step changed c
    pool.run("a_sum = sum(p.to_local().sum().item() for p in a.parameters())", cell=4)
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, cell=5, stream=False)
    report = pool.recover()
    assert [e.cell for e in report.replayed] == [1]
    after = values(pool, STATE)
    for rank in after:
        assert after[rank]["a"] == built[rank]["a"], f"rank {rank}: a is not what In[1] built"
        assert after[rank]["b"] == built[rank]["b"], f"rank {rank}: b is not what In[1] built"
        assert after[rank]["c"] == taken[rank]["c"], f"rank {rank}: c is not the snapshot's"
    # Only what the snapshot writes was not drawn: c's weight and bias.
    assert report.replay_outcome.skipped_inits == 2
    assert report.replay_outcome.run_inits > 0
    # The report names what came back from where, and what did not.
    text = str(report)
    sid = report.snapshot.id
    assert f"restored from {sid}: c (the model), opt_c (the optimizer)" in text
    assert {"a", "b", "fingerprint", "FSDP", "fully_shard"} <= set(report.rebuilt)
    assert {"c", "opt_c", "torch", "rank"}.isdisjoint(report.rebuilt)
    lost = {n.name: n for n in report.lost}
    assert set(lost) == {"snap", "a_sum", "os", "signal"}  # os, signal: the fatal cell's
    assert lost["a_sum"].how == "In[4] defines it, after the snapshot: run In[4] again"
    assert lost["snap"].how.startswith("In[3] defines it and took the snapshot")
    assert "open" not in report.rebuilt
    assert "lost (4): a_sum (In[4] defines it, after the snapshot: run In[4] again)" in text
    return report


def test_a_model_the_snapshot_does_not_hold_comes_back_as_built(pool: Pool) -> None:
    pool.restart()
    recover_the_model_the_snapshot_does_not_hold(pool)


@pytest.mark.world4
def test_a_model_the_snapshot_does_not_hold_comes_back_as_built_at_4_ranks(profile_dir) -> None:
    pool = Pool(n=4, devices="cpu", profile_dir=profile_dir, show_topology=False)
    try:
        pool.start()
        recover_the_model_the_snapshot_does_not_hold(pool)
    finally:
        record(pool)
        pool.stop()


def test_a_skipped_tensor_the_snapshot_does_not_write_makes_the_replay_run_every_draw(pool):
    # In[1]'s Linear ended under `model`, which the snapshot restores; but In[2] moved it
    # to `other` and built a new `model`. Its skipped initialization is found unset, and
    # the replay runs again drawing everything: `other` comes back as In[1] built it.
    pool.restart()
    pool.run("import torch, fsdp_interactive\ntorch.manual_seed(3)\nmodel = torch.nn.Linear(8, 8)")
    pool.run(
        "other = model\nmodel = torch.nn.Linear(8, 8)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        cell=2,
    )
    built = values(pool, "other.weight.sum().item(), model.weight.sum().item()")
    pool.run("fsdp_interactive.snapshot(model=model, optimizer=opt)", cell=3)
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, cell=4, stream=False)
    report = pool.recover()
    assert values(pool, "other.weight.sum().item(), model.weight.sum().item()") == built
    assert report.replayed_again.startswith("the replay skipped the initialization of other.")
    assert "replay: ran again with every initialization" in str(report)
    assert report.replay_outcome.skipped_inits == 0


class _Recorded(io.TextIOBase):
    """A terminal's stdout and stderr in one: every write in order, beside the markers the
    test adds (the phase line moves on stderr, finished steps are lines of stdout)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def write(self, text: str) -> int:
        self.events.append(text)
        return len(text)

    def isatty(self) -> bool:
        return True


def test_each_phase_is_shown_before_the_recovery_waits_in_it(pool, monkeypatch):
    """The line of each phase is written before the work it names begins: ending the old
    group, starting the new one, replaying each cell, loading the snapshot."""
    from fsdp_interactive.pool import _recovery

    pool.restart()
    pool.run("import torch, fsdp_interactive\nnet = torch.nn.Linear(4, 4)", cell=1, stream=False)
    pool.run("n = 1", cell=2, stream=False, replay=True)
    pool.run("fsdp_interactive.snapshot(model=net)", cell=3, stream=False)
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, cell=4, stream=False)
    out = _Recorded()
    for name in ("end_group", "start_group", "_restore"):
        real = getattr(_recovery, name)

        def marked(*args, _real=real, _name=name, **kwargs):
            out.events.append(f"<{_name}>")
            return _real(*args, **kwargs)

        monkeypatch.setattr(_recovery, name, marked)
    real_run = Pool.run

    def run(self, code, *args, replayed=None, **kwargs):
        if replayed is not None:
            out.events.append(f"<replay {kwargs.get('cell')}>")
        return real_run(self, code, *args, replayed=replayed, **kwargs)

    monkeypatch.setattr(Pool, "run", run)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", out)
    pool.recover()
    shown = [e.strip("\r ") for e in out.events if e.strip("\r ")]

    def before(line: str, marker: str) -> None:
        first = next(i for i, e in enumerate(shown) if e.startswith(line))
        assert first < shown.index(marker), (line, marker, shown)

    assert shown[0] == "recovery: ending the old group ..."  # the first thing it does
    before("recovery: ending the old group ...", "<end_group>")
    before("recovery: starting a fresh group of 2 ranks ...", "<start_group>")
    before("recovery: replaying In[1] (1 of 2) ...", "<replay 1>")
    before("recovery: replaying In[2] (2 of 2) ...", "<replay 2>")
    before("recovery: loading s", "<_restore>")
    assert shown.index("<_restore>") < next(
        i for i, e in enumerate(shown) if e.startswith("recovered to the snapshot")
    )
    # Finished steps stay as lines; the moving line is gone at the end.
    text = "".join(out.events)
    assert "recovery: a fresh group of 2 ranks is up (" in text
    assert "recovery: replayed In[2] in " in text
    assert text.endswith("\n")
