"""An ``Accelerator`` loop and Lightning Fabric in a real 2-rank pool, from the recipes of
docs/frameworks.md: both shard every parameter with ``fully_shard`` over the pool's ranks
and group and train; what each does on CPU ranks without the recipe."""

from __future__ import annotations

import ast

import pytest

from tests.frameworks._checks import check_kit_views
from tests.frameworks._installed import require
from tests.frameworks._recipes import recipe

FRESH_ACCELERATE = (
    "from accelerate.state import AcceleratorState\nAcceleratorState._reset_state(True)\n"
)
PROBES = "from tests.frameworks._probes import sharding\n"


def _values(pool, expression: str) -> dict[int, object]:
    results = pool.run(PROBES + expression, stream=False, journal=False).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


#: Elements of the recipes' Llama: embedding and head (128 x 64 each), per layer the q and o
#: projections (64 x 64), k and v (64 x 32: 2 key-value heads), the MLP (3 x 64 x 128) and
#: two norms, then the final norm.
LLAMA_ELEMENTS = 2 * 128 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64


def _check_sharded_training(results: dict) -> None:
    layouts = {rank: values[0] for rank, values in results.items()}
    assert sum(layout["local"] for layout in layouts.values()) == LLAMA_ELEMENTS
    for layout, losses in (values[:2] for values in results.values()):
        assert layout["placements"] == ["(Shard(dim=0),)"]
        assert layout["local"] == pytest.approx(LLAMA_ELEMENTS / 2, rel=0.05)
        assert layout["optimizer_holds_the_model"]
        assert len(losses) == 16 and sum(losses[-4:]) < sum(losses[:4]), losses


def test_an_accelerator_loop_shards_with_fsdp2_and_trains(framework_pool):
    require("transformers", "accelerate")
    framework_pool.run(FRESH_ACCELERATE + recipe("accelerator-fsdp2"), stream=False)
    results = _values(framework_pool, "(sharding(model, optimizer), losses)")
    assert {layout["class"] for layout, _ in results.values()} == {"FSDPLlamaForCausalLM"}
    _check_sharded_training(results)
    check_kit_views(framework_pool, "model")


ACCELERATE_WITHOUT_RECIPE = """
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

def chosen(**options):
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), **options)
    prepared = accelerator.prepare(LlamaForCausalLM(config))
    return str(accelerator.distributed_type), type(prepared).__name__

(chosen(cpu=True), chosen())
"""


def test_without_the_recipe_accelerate_picks_ddp_or_no_distribution(framework_pool):
    require("transformers", "accelerate")
    results = _values(framework_pool, FRESH_ACCELERATE + ACCELERATE_WITHOUT_RECIPE)
    for with_cpu, without_cpu in results.values():
        assert with_cpu == ("DistributedType.MULTI_CPU", "DistributedDataParallel")
        assert without_cpu == ("DistributedType.NO", "LlamaForCausalLM")


def test_fabric_shards_with_model_parallel_strategy_over_the_pools_group(framework_pool):
    require("transformers", "lightning")
    framework_pool.run(recipe("fabric-model-parallel"), stream=False)
    results = _values(
        framework_pool,
        "(sharding(model, optimizer), losses, fabric.global_rank, fabric.world_size,"
        " type(model).__name__, sharding(model.module)['class'])",
    )
    for rank, (_, _, fabric_rank, world, wrapper, inner) in results.items():
        assert (fabric_rank, world) == (rank, 2)
        assert (wrapper, inner) == ("_FabricModule", "FSDPLlamaForCausalLM")
    _check_sharded_training(results)
    # the views take Fabric's wrapper as it is and show the clean names
    check_kit_views(framework_pool, "model")


FABRIC_WITHOUT_RECIPE = """
def refusal(strategy):
    try:
        L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[LightningEnvironment()])
    except Exception as error:
        return f"{type(error).__name__}: {error}"

(refusal("fsdp"), refusal("ddp"))
"""


def test_fabric_refuses_its_fsdp_and_ddp_strategies_on_cpu_ranks_in_a_pool(framework_pool):
    require("lightning")
    framework_pool.run(
        "import lightning as L\n"
        "from lightning.fabric.plugins.environments import LightningEnvironment\n",
        stream=False,
    )
    for fsdp, ddp in _values(framework_pool, FABRIC_WITHOUT_RECIPE).values():
        assert fsdp.startswith("ValueError: You selected the FSDP strategy but FSDP is only")
        assert "available on GPU" in fsdp
        assert ddp.startswith("RuntimeError: `Fabric(strategy='ddp')` is not compatible with")
        assert "interactive environment" in ddp
