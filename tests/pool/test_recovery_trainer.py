"""A Hugging Face ``Trainer`` in a real 2-rank pool (a tiny Llama built from its config, no
downloads): its optimizer and scheduler are built inside ``trainer.train()``, which a
recovery must not replay. With docs/recovery.md's recipe (``create_optimizer_and_scheduler``
in the cell that builds the trainer) the recovery replays that cell only and restores the
snapshot into ``trainer.model``, ``trainer.optimizer`` and ``trainer.lr_scheduler`` bit for
bit, and training goes on; without it the recovery fails naming what it could not put back.

Needs ``transformers`` and ``accelerate`` (the Trainer's own requirement): skipped without
them, failed instead with ``FSDPI_REQUIRE_HF=1`` (CI).
"""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

from fsdp_interactive.pool import Pool, RankDied
from fsdp_interactive.pool.errors import RecoveryError

REQUIRE_ENV = "FSDPI_REQUIRE_HF"

BUILD = """
import hashlib, tempfile
import torch
import fsdp_interactive
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

config = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)
model = LlamaForCausalLM(config)

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}

args = TrainingArguments(
    output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=3, seed=0,
    report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())

def fingerprint():
    digest = hashlib.sha256()
    for name, param in sorted(trainer.model.named_parameters()):
        digest.update(param.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        for value in trainer.optimizer.state.get(param, {}).values():
            digest.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), trainer.lr_scheduler.last_epoch
"""
RECIPE = "trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)\n"
TRAIN = "trainer.train().global_step"
SNAPSHOT = (
    "fsdp_interactive.snapshot(model=trainer.model, optimizer=trainer.optimizer, "
    "sched=trainer.lr_scheduler, step=3).names"
)
KILL_RANK_1 = "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"


@pytest.fixture(scope="module", autouse=True)
def _trainer_installed() -> None:
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if not missing:
        return
    reason = f"{' and '.join(missing)} not installed: the Trainer needs both"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires the Hugging Face tests to run)")
    pytest.skip(reason)


def values(pool: Pool, expression: str, cell: int | None = None) -> dict[int, object]:
    results = pool.run(expression, cell=cell, stream=False, journal=cell is not None).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


def kill_rank_1(pool: Pool, cell: int) -> None:
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, cell=cell, stream=False)


def test_a_trainer_recovers_without_replaying_train(pool: Pool):
    pool.restart()
    pool.run(BUILD + RECIPE, cell=1, stream=False)
    assert values(pool, TRAIN, cell=2) == {0: 3, 1: 3}
    names = values(pool, SNAPSHOT, cell=3)[0]
    # trainer.model is also the variable model: the path given is recorded.
    assert names == {
        "model": "trainer.model",
        "optimizer": "trainer.optimizer",
        "stateful": {"sched": "trainer.lr_scheduler"},
    }
    saved = values(pool, "fingerprint()")
    kill_rank_1(pool, cell=4)
    plan = pool.recover(dry_run=True)
    assert "  In[2] skipped: uses trainer, whose state the snapshot holds" in plan.lines()
    report = pool.recover()
    assert [e.cell for e in report.replayed] == [1]
    assert values(pool, "fingerprint()") == saved
    # Training goes on from the restored state (the Trainer's loop starts again at step 0).
    assert values(pool, TRAIN, cell=5) == {0: 3, 1: 3}


def test_without_the_recipe_the_recovery_names_what_it_could_not_put_back(pool: Pool):
    pool.restart()
    pool.run(BUILD, cell=1, stream=False)
    values(pool, TRAIN, cell=2)
    values(pool, SNAPSHOT, cell=3)
    kill_rank_1(pool, cell=4)
    with pytest.raises(RecoveryError) as failed:
        pool.recover()
    message = str(failed.value)
    assert "'optimizer' was at trainer.optimizer, and trainer.optimizer is None" in message
    assert "'sched' was at trainer.lr_scheduler" in message
    assert "trainer.create_optimizer()" in message and "docs/recovery.md" in message
    assert pool.running
