"""HYBRID_SHARD's default mesh on hosts that carry different numbers of ranks.

The pool gives every rank the ``LOCAL_WORLD_SIZE`` of its host, so uneven hosts give
ranks different values; here the ranks of one real gloo group take such values (this
machine is their only host, so the message names it once per value).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import ShardingStrategy

from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.fsdp._mesh import describe_hosts
from tests.fsdp import _common as C


def hybrid_with_local_world_sizes(values: list[str], strategy: str) -> str:
    """Wrap with ``strategy`` while this rank's LOCAL_WORLD_SIZE is ``values[rank]``;
    the error's text ("" when it built), then FULL_SHARD must still work."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = values[dist.get_rank()]
    try:
        try:
            FSDP(C.make_model(0), sharding_strategy=ShardingStrategy[strategy])
            error = ""
        except ValueError as exc:
            error = str(exc)
        full = FSDP(C.make_model(0), sharding_strategy=ShardingStrategy.FULL_SHARD)
        assert tuple(full.embed.weight.device_mesh.shape) == (dist.get_world_size(),)
        return error
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def test_uneven_ranks_per_host_fail_on_every_rank_naming_hosts_and_remedies(ranks2):
    errors = ranks2.run(hybrid_with_local_world_sizes, ["2", "1"], "HYBRID_SHARD")
    host = socket.gethostname()
    assert errors[0] == errors[1]  # the same error everywhere: no rank waits for the others
    assert "HYBRID_SHARD needs the same number of ranks on every host" in errors[0]
    assert f"{host}: 2 ranks (rank 0, LOCAL_WORLD_SIZE=2; rank 1, LOCAL_WORLD_SIZE=1)" in errors[0]
    assert "divide the world size 2" in errors[0]
    assert "device_mesh=init_device_mesh(" in errors[0]
    assert "sharding_strategy=ShardingStrategy.FULL_SHARD" in errors[0]


def test_a_local_world_size_that_does_not_divide_the_world_names_the_hosts(ranks2):
    errors = ranks2.run(hybrid_with_local_world_sizes, ["3", "3"], "_HYBRID_SHARD_ZERO2")
    assert errors[0] == errors[1]
    assert "LOCAL_WORLD_SIZE=3 must be a positive divisor of the world size 2" in errors[0]
    assert f"{socket.gethostname()}: 2 ranks (ranks 0-1, LOCAL_WORLD_SIZE=3)" in errors[0]
    assert "sharding_strategy=ShardingStrategy.FULL_SHARD" in errors[0]


def test_even_hosts_build_the_hybrid_mesh(ranks2):
    assert ranks2.run(hybrid_with_local_world_sizes, ["1", "1"], "HYBRID_SHARD") == ["", ""]


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (
            [("hosta", "2"), ("hosta", "2"), ("hostb", "1")],
            "hosta: 2 ranks (ranks 0-1, LOCAL_WORLD_SIZE=2); "
            "hostb: 1 rank (rank 2, LOCAL_WORLD_SIZE=1)",
        ),
        (
            [("a", None), ("b", "2"), ("a", None)],
            "a: 2 ranks (ranks 0, 2, LOCAL_WORLD_SIZE=unset); b: 1 rank (rank 1, LOCAL_WORLD_SIZE=2)",
        ),
    ],
)
def test_host_description(layout, expected):
    assert describe_hosts(layout) == expected
