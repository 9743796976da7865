"""The Hugging Face Trainer in a real 2-rank pool, from the recipes of docs/frameworks.md:
with FSDP v2 (``fully_shard``) and v1 (torch's ``FullyShardedDataParallel``) on CPU ranks it
shards every parameter over the ranks and logs the losses and gradient norms (which it
clips by) of the same Trainer without sharding (the DDP accelerate falls back to on CPU
ranks), to 1e-5; what the Trainer does when asked for FSDP on CPU ranks without the
recipe."""

from __future__ import annotations

import ast

import pytest

from tests.frameworks._checks import check_kit_views
from tests.frameworks._installed import require
from tests.frameworks._recipes import recipe

pytestmark = pytest.mark.usefixtures("_frameworks")

#: Every Trainer and Accelerator of a rank shares accelerate's per-process state: each test
#: starts from a fresh one (on the ranks, before the recipe).
FRESH_ACCELERATE = (
    "from accelerate.state import AcceleratorState\nAcceleratorState._reset_state(True)\n"
)
PROBES = (
    "from tests.frameworks._probes import clipped_by_the_true_norm, clipped_norms, logged, "
    "sharding\n"
)
# New TrainingArguments: each resets accelerate's per-process state when the Trainer sets
# up its devices (one reused after another Trainer keeps a stale state).
DDP_REFERENCE = """
torch.manual_seed(0)
reference_args = TrainingArguments(**{args}.to_dict())
reference = Trainer(model=LlamaForCausalLM(config), args=reference_args, train_dataset=data)
reference.train()
"""


@pytest.fixture
def _frameworks() -> None:
    require("transformers", "accelerate")


def _values(pool, expression: str) -> dict[int, object]:
    results = pool.run(PROBES + expression, stream=False, journal=False).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


def _train_and_compare(pool, recipe_name: str, trainer: str, args: str) -> dict[int, object]:
    pool.run(recipe("trainer-subclass") + recipe(recipe_name), stream=False)
    sharded = _values(
        pool, f"(sharding({trainer}.model_wrapped, {trainer}.optimizer), logged({trainer}))"
    )
    pool.run(DDP_REFERENCE.format(args=args), stream=False)
    reference = _values(pool, "(sharding(reference.model_wrapped), logged(reference))")
    check_kit_views(pool, f"{trainer}.model_wrapped")
    check_kit_views(pool, "reference.model_wrapped")
    for rank in (0, 1):
        layout, logs = sharded[rank]
        ddp_layout, ddp_logs = reference[rank]
        assert ddp_layout["class"] == "DistributedDataParallel"
        assert layout["optimizer_holds_the_model"]
        assert len(logs) == 4 and logs[-1][0] < logs[0][0], logs
        # the gradient norm is what the Trainer clips by (max_grad_norm=1.0): a wrong one
        # changes the training, not only the log
        assert [v for entry in logs for v in entry] == pytest.approx(
            [v for entry in ddp_logs for v in entry], rel=1e-5
        ), (logs, ddp_logs)
    # the ranks hold the model's elements between them, about half each (DDP: all on each)
    total = reference[0][0]["local"]
    assert sum(sharded[rank][0]["local"] for rank in (0, 1)) == total
    assert all(abs(sharded[rank][0]["local"] / total - 0.5) < 0.05 for rank in (0, 1))
    return {rank: sharded[rank][0] for rank in sharded}


def test_trainer_fsdp2_shards_every_parameter_and_trains_like_ddp(framework_pool):
    layouts = _train_and_compare(framework_pool, "trainer-fsdp2", "trainer", "args")
    for layout in layouts.values():
        assert layout["class"] == "FSDPLlamaForCausalLM"
        assert layout["placements"] == ["(Shard(dim=0),)"]


def test_trainer_fsdp1_wraps_in_torch_fsdp_and_trains_like_ddp(framework_pool):
    layouts = _train_and_compare(framework_pool, "trainer-fsdp1", "trainer_v1", "args_v1")
    for layout in layouts.values():
        # torch FSDP1 with original parameters (the Trainer's default): plain views of the
        # rank's part of each flat parameter
        assert layout["class"] == "FullyShardedDataParallel"
        assert layout["placements"] == ["plain"]


ASKED_WITHOUT_RECIPE = """
def outcome(**changes):
    try:
        asked = TrainingArguments(**{**args.to_dict(), "max_steps": 1, **changes})
        t = Trainer(model=LlamaForCausalLM(config), args=asked, train_dataset=data)
        t.train()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return type(t.model_wrapped).__name__
v1 = {"fsdp_version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
(outcome(use_cpu=False), outcome(fsdp_config=v1),
 outcome(fsdp_config={**v1, "sync_module_states": False}), outcome())
"""


def test_without_the_recipe_the_trainer_refuses_or_falls_back_to_ddp(framework_pool):
    """What docs/frameworks.md's table says the Trainer does when asked for FSDP on CPU."""
    defines_args = recipe("trainer-fsdp2").replace("trainer.train()", "")
    framework_pool.run(recipe("trainer-subclass") + defines_args, stream=False)
    results = _values(framework_pool, ASKED_WITHOUT_RECIPE)
    for without_cpu, v1, v1_unsynced, v2 in results.values():
        assert without_cpu == "ValueError: Using fsdp only works in distributed training."
        assert v1.startswith("RuntimeError: FSDP parameter initialization with")
        assert "sync_module_states=True" in v1 and "not supported on cpu" in v1
        assert v1_unsynced == v2 == "DistributedDataParallel"


KILL_RANK_1 = "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
STATE = "__import__('tests.checkpoint._wrappings', fromlist=['digest']).digest(model, optim)"


def _snapshot_kill_and_recover(pool, trainer: str):
    """Snapshot ``model`` and ``optim`` at the trainer's step, SIGKILL rank 1, recover: every
    rank's state is the snapshot's, bit for bit; the recovery's report."""
    from fsdp_interactive.pool import RankDied

    pool.run(
        "import fsdp_interactive\nfsdp_interactive.snapshot(model=model, optimizer=optim, "
        f"step={trainer}.state.global_step)",
        stream=False,
    )
    at_snapshot = _values(pool, STATE)
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, stream=False)
    report = pool.recover()
    assert report.snapshot.step == 20
    assert _values(pool, STATE) == at_snapshot
    return report


@pytest.mark.timing
def test_a_trainer_prepared_in_a_cell_of_its_own_recovers_and_trains_on(framework_pool):
    """docs/frameworks.md's recovery recipe: the sharded model and optimizer prepared in a
    replayed cell, ``train()`` in a training cell, a snapshot, a SIGKILL, ``recover()``:
    every rank's state is the snapshot's, and ``train()`` goes on with those objects."""
    pool = framework_pool
    pool.restart()  # a journal of this test's cells only
    pool.run(recipe("setup"), stream=False)
    pool.run(recipe("trainer-subclass") + recipe("trainer-fsdp2").split("torch.manual_seed")[0])
    pool.run(recipe("trainer-prepare"), stream=False)
    pool.run("trainer.train()", stream=False, replay=False)
    report = _snapshot_kill_and_recover(pool, "trainer")
    # replayed: the setup, the Trainer and its arguments, the prepared model and optimizer
    assert len(report.replayed) == 3
    pool.run("trainer.train()", stream=False, replay=False)
    resumed = _values(
        pool,
        "(logged(trainer), trainer.optimizer.optimizer is optim.optimizer,"
        " trainer.model_wrapped is model, int(next(iter(optim.state.values()))['step']))",
    )
    for logs, same_optimizer, same_model, adam_steps in resumed.values():
        assert same_optimizer and same_model
        assert adam_steps == 40  # the restored 20 steps and 20 more
        assert len(logs) == 4


@pytest.mark.timing
def test_the_trainer_fsdp1_recipe_recovers_bit_for_bit_and_clips_by_the_true_norm(
    framework_pool,
):
    """docs/frameworks.md's FSDP v1 recipe: the model wrapped in torch FSDP1 and its
    optimizer prepared in a replayed cell, ``train()`` in a training cell: the Trainer
    clips by the true global gradient norm (not a rank's own), before and after a SIGKILL
    and ``recover()``, which restores every rank's state bit for bit."""
    pool = framework_pool
    pool.restart()
    pool.run(recipe("setup"), stream=False)
    pool.run(recipe("trainer-subclass"), stream=False)
    pool.run(FRESH_ACCELERATE + recipe("trainer-fsdp1-prepare"), stream=False)
    train = "norms = clipped_norms(trainer_v1)\ntrainer_v1.train()"
    pool.run(PROBES + train, stream=False, replay=False)
    checks = "(clipped_by_the_true_norm(trainer_v1, norms), type(model).__name__)"
    for attempt in ("before", "after the recovery"):
        found = _values(pool, checks)
        assert found[0] == found[1]  # every rank logged and clipped by the same norm
        pairs, kind = found[0]
        assert kind == "FullyShardedDataParallel" and len(pairs) == 4, (attempt, pairs)
        for logged_norm, clipped in pairs:
            assert clipped == pytest.approx(min(logged_norm, 1.0), rel=1e-5), (attempt, pairs)
        if attempt == "after the recovery":
            break
        _snapshot_kill_and_recover(pool, "trainer_v1")
        pool.run(PROBES + train, stream=False, replay=False)
        assert _values(pool, "trainer_v1.optimizer.optimizer is optim") == {0: True, 1: True}
