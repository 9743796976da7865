"""``Pool.export`` on a real 2-rank pool: notebook sessions built here (a quickstart-like
one with pushes, a progress bar, random draws and a cell on one rank; a recovery-like one
with a snapshot, a killed rank and ``recover()``; one that ran a torchrun script, paused
it, changed it and continued) are exported, and the exported script, run by ``torchrun``
at the pool's world size, holds the notebook's parameters and optimizer state bit for
bit; ``from_snapshot`` resumes as the notebook continued. Every refusal, with its reason
and nothing written."""

from __future__ import annotations

import os
import re
import signal
import stat
import textwrap
from pathlib import Path

import pytest
import torch

from fsdp_interactive.notebook._snapshot_taking import take_snapshot
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.pool import ExportRefused, Pool, RankDied, RankError
from tests.torchrun_reference import SCRIPTS, differences, run_exported, save_pool_state

BUILD = """
import torch.nn.functional as F
import fsdp_interactive
from fsdp_interactive.examples import TinyTransformer, TransformerBlock, synthetic_batch
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

torch.manual_seed(0)
model = FSDP(
    TinyTransformer(),
    auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
    device_id=device,
    use_orig_params=True,
)
optimizer = torch.optim.AdamW(model.parameters(), lr=lr)


def train(steps):
    from tqdm.auto import tqdm

    for step in tqdm(range(steps), desc="training"):
        inputs, targets = synthetic_batch(step, rank)
        noise = 1e-3 * torch.randn(())  # draws from the generators the cell started with
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()) + noise
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return loss.item()
"""


def cell(pool: Pool, number: int, code: str, **options) -> None:
    pool.run(textwrap.dedent(code), cell=number, stream=False, **options)


def exported_equals_pool(pool: Pool, script: Path, tmp_path: Path, name: str) -> list[str]:
    save_pool_state(pool, tmp_path / f"{name}-pool")
    run_exported(script, pool.world_size, tmp_path / f"{name}-job")
    return differences(tmp_path / f"{name}-pool", tmp_path / f"{name}-job", pool.world_size)


def test_quickstart_like_session_exports_and_reproduces_bit_for_bit(pool: Pool, tmp_path: Path):
    pool.restart()
    pool.push({"lr": 3e-3, "steps": 4})
    cell(pool, 2, BUILD)
    cell(pool, 3, "loss = train(steps)")
    cell(pool, 4, "extra = torch.rand(3)  # rank 0 only", targets=[0])
    cell(pool, 5, "for group in optimizer.param_groups:\n    group['lr'] = lr / 2\nloss = train(2)")
    with pytest.raises(RankError):
        cell(pool, 6, "raise RuntimeError('a failed cell builds nothing')")

    plan = pool.export(tmp_path / "job.py", dry_run=True)
    assert not plan.written and not (tmp_path / "job.py").exists()
    labels = [piece.label for piece in plan.pieces]
    assert labels == ["push lr, steps", "In[2]", "In[3]", "In[4]", "In[5]"]
    assert "In[6] (error: it built nothing to keep)" in plan.skipped

    plan = pool.export(tmp_path / "job.py", sbatch=True)
    assert plan.written and plan.command.endswith(f"--nproc-per-node 2 {tmp_path / 'job.py'}")
    for written in (tmp_path / "job.py", tmp_path / "job.values.json", tmp_path / "job.sbatch"):
        assert stat.S_IMODE(written.stat().st_mode) == 0o600
    text = (tmp_path / "job.py").read_text()
    assert "if rank in (0,):\n    extra = torch.rand(3)" in text
    assert "lr = _values['pushes']['1']['lr']" in text
    assert "srun --ntasks-per-node=1" in (tmp_path / "job.sbatch").read_text()
    assert exported_equals_pool(pool, tmp_path / "job.py", tmp_path, "now") == []


def test_values_file_is_checked_before_it_is_read(pool: Pool, tmp_path: Path):
    from fsdp_interactive import job

    pool.restart()
    pool.push({"lr": 1e-3, "table": {1: (b"\x00", None, 2.5)}, "ids": torch.arange(3)})
    cell(pool, 1, "weights = torch.full((2,), lr)")
    pool.export(tmp_path / "small.py")
    script, values = tmp_path / "small.py", tmp_path / "small.values.json"
    digest = re.search(r"'small.values.json', '([0-9a-f]{64})'", script.read_text()).group(1)
    pushed = job.load_values(str(script), "small.values.json", digest)["pushes"]["1"]
    assert pushed["lr"] == 1e-3 and pushed["table"] == {1: (b"\x00", None, 2.5)}
    assert torch.equal(pushed["ids"], torch.arange(3))

    data = bytearray(values.read_bytes())
    data[-2] ^= 1  # another file under the same name
    values.write_bytes(bytes(data))
    with pytest.raises(job.ExportedJobError, match="is not the values file this script was"):
        job.load_values(str(script), "small.values.json", digest)
    pool.export(tmp_path / "small.py")  # written again: its own file
    digest = re.search(r"'small.values.json', '([0-9a-f]{64})'", script.read_text()).group(1)
    os.chmod(values, 0o666)
    with pytest.raises(job.ExportedJobError, match="another user could have changed it"):
        job.load_values(str(script), "small.values.json", digest)


def test_recovered_session_and_from_snapshot_continuation(pool: Pool, tmp_path: Path):
    pool.restart()
    cell(pool, 1, "lr = 3e-3\n" + BUILD)  # a recovery replays cells, not pushes
    cell(pool, 2, "loss = train(3)", replay=False)
    take_snapshot(pool, "model", "optimizer", keep_last=4)
    snapshot = pool.snapshots()[-1].id
    cell(pool, 4, "loss = train(2)", replay=False)
    save_pool_state(pool, tmp_path / "continued-pool")
    with pytest.raises(RankDied):
        cell(pool, 5, "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)")
    pool.recover(snapshot)
    cell(pool, 6, "loss = train(2)", replay=False)

    # the recovered group: its state is the snapshot's, then In[6]
    plan = pool.export(tmp_path / "recovered.py")
    assert plan.restore.startswith(f"the snapshot {snapshot}")
    assert [p.label for p in plan.pieces][-2:] == [f"restore {plan.restore}", "In[6]"]
    assert (tmp_path / f"recovered.{snapshot}" / "manifest.json").exists()
    assert exported_equals_pool(pool, tmp_path / "recovered.py", tmp_path, "recovered") == []

    # from the snapshot, with the cells the notebook ran after it (In[4]) as training
    plan = pool.export(tmp_path / "resume.py", from_snapshot=snapshot, train=[4])
    assert "In[2] (marked %%fsdp --no-replay; the snapshot holds its effect)" in plan.skipped
    run_exported(tmp_path / "resume.py", 2, tmp_path / "resume-job")
    assert differences(tmp_path / "continued-pool", tmp_path / "resume-job", 2) == []


def test_session_with_a_paused_script_run_exports_and_reproduces(pool: Pool, tmp_path: Path):
    pool.restart()
    script = SCRIPTS / "plain_fsdp1.py"
    pool.run_script(script, ["--steps", "6"], stop_at=2)
    cell(pool, 2, "for group in optimizer.param_groups:\n    group['lr'] = 5e-3")
    pool.continue_script(stop_at=4)
    cell(pool, 4, "probe = torch.randn(2)")
    plan = pool.export(tmp_path / "from_script.py")
    whats = [piece.why for piece in plan.pieces]
    assert whats[0].startswith("runs plain_fsdp1.py as the pool did, to its pause after step 2")
    assert whats[2] == "continues plain_fsdp1.py to its pause after step 4"
    assert exported_equals_pool(pool, tmp_path / "from_script.py", tmp_path, "script") == []
    pool.continue_script(stop=True)


def test_what_cannot_be_carried_is_refused_by_cell_with_its_reason(pool: Pool, tmp_path: Path):
    pool.restart()
    cell(pool, 1, "import torch\nweights = torch.ones(4)\nmodel = torch.nn.Linear(4, 4)")
    cell(pool, 2, "%time total = weights.sum()")
    cell(pool, 3, "from IPython.display import display\ndisplay(weights)")
    pool.call(_set_hidden)  # a value the journal never saw
    cell(pool, 4, "print(hidden)")
    pool.push({"config": _Config()})
    cell(pool, 5, "local_too = 1")
    pool.journal.mark(pool.journal.entries[-1], "local")
    RankModel(pool, "model").edit("weight", "x * 0")
    target = tmp_path / "refused.py"

    with pytest.raises(ExportRefused) as refused:
        pool.export(target, train=[99])
    reasons = {piece.label: piece.why for piece in refused.value.plan.refused}
    assert "uses IPython syntax (%time total = weights.sum())" in reasons["In[2]"]
    assert "shows widgets or displays (import IPython.display)" in reasons["In[3]"]
    assert "it reads hidden, which nothing exported before it defines" in reasons["In[4]"]
    assert "config (a tests.pool.test_export._Config)" in reasons["push config"]
    assert "also ran in the kernel (%%fsdp --local)" in reasons["In[5]"]
    assert "model: weight edited to x * 0" in reasons["a change after In[5]"]
    assert "no cell In[99]" in reasons["--train 99"]
    assert "%fsdp export PATH --dry-run" in refused.value.notebook_message()
    assert not target.exists() and not (tmp_path / "refused.values.json").exists()
    plan = pool.export(target, dry_run=True, train=[99])  # the same list, as a plan
    assert {p.label for p in plan.refused} == set(reasons)

    with pytest.raises(ExportRefused, match="no snapshot 'nope'"):
        pool.export(target, from_snapshot="nope")
    with pytest.raises(ExportRefused, match="not a persisted snapshot"):
        pool.export(target, from_checkpoint=tmp_path)
    with pytest.raises(ValueError, match="from_snapshot or from_checkpoint, not both"):
        pool.export(target, from_snapshot="a", from_checkpoint=tmp_path)
    with pytest.raises(ValueError, match=r"ending in \.py"):
        pool.export(tmp_path / "job.txt")
    with pytest.raises(ValueError, match="nodes must be a number >= 1"):
        pool.export(target, nodes=0)
    with pytest.raises(ValueError, match="train must be cell numbers"):
        pool.export(target, train=["In[1]"])


class _Config:
    """A pushed object of a class of its own: not written to a values file."""


def _set_hidden() -> None:
    from fsdp_interactive.pool.rank._engine_shell import user_namespace

    user_namespace()["hidden"] = 42


def test_export_refuses_while_the_pool_is_broken(pool: Pool, tmp_path: Path):
    pool.restart()
    os.kill(pool.topology[1].pid, signal.SIGKILL)
    with pytest.raises(RankDied):
        pool.run("1", stream=False)
    with pytest.raises(ExportRefused, match="the pool is broken") as refused:
        pool.export(tmp_path / "job.py")
    assert "%fsdp recover" in refused.value.notebook_message()
    pool.restart()
