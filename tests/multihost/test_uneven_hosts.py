"""A pool whose hosts carry different numbers of ranks: hosta 2, hostb 1 (ssh launcher).

HYBRID_SHARD's default mesh (one replica per host) cannot be built on it; every rank
fails with the same error naming the hosts, and FULL_SHARD works on the same pool.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fsdp_interactive.pool import Pool, RankError
from tests.multihost.launchers import running_ssh_pool

pytestmark = pytest.mark.multihost

WRAP = (
    "from torch import nn\n"
    "from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy\n"
    "model = FSDP(nn.Linear(8, 8), sharding_strategy=ShardingStrategy.{strategy})\n"
    "tuple(model.weight.device_mesh.shape)"
)


@pytest.fixture(scope="module")
def uneven_pool(testhosts, tmp_path_factory) -> Iterator[Pool]:
    profile_dir = str(tmp_path_factory.mktemp("uneven-profile"))
    with running_ssh_pool(testhosts, {"hosta": 2, "hostb": 1}, profile_dir) as pool:
        yield pool


def test_hybrid_shard_on_uneven_hosts_names_hosts_and_what_to_pass(uneven_pool):
    assert [(r.host, r.local_rank) for r in uneven_pool.topology] == [
        ("hosta", 0),
        ("hosta", 1),
        ("hostb", 0),
    ]
    with pytest.raises(RankError) as caught:
        uneven_pool.run(WRAP.format(strategy="HYBRID_SHARD"), stream=False, timeout=120)
    error = caught.value
    assert error.ranks == [0, 1, 2], error  # every rank fails: none waits for the others
    text = str(error)
    assert "HYBRID_SHARD needs the same number of ranks on every host" in text
    assert (
        "hosta: 2 ranks (ranks 0-1, LOCAL_WORLD_SIZE=2); "
        "hostb: 1 rank (rank 2, LOCAL_WORLD_SIZE=1)" in text
    )
    assert "divide the world size 3" in text
    assert "device_mesh=init_device_mesh(" in text
    assert "sharding_strategy=ShardingStrategy.FULL_SHARD" in text
    shapes = uneven_pool.run(WRAP.format(strategy="FULL_SHARD"), stream=False).results
    assert shapes == {0: "(3,)", 1: "(3,)", 2: "(3,)"}
