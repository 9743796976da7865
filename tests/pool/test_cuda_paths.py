"""The pool's CUDA paths through a real pool of CPU ranks, with CUDA stood in for
(:mod:`tests.pool.cuda_standins`): device tensors never reach the kernel, a rank waiting
for its GPU behind an unfinished NCCL collective is reported as blocked in it, and the
NCCL watchdog is held while a person debugs. The GPU versions are in ``test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_interactive.pool import Pool, RankError, RankTimeout
from fsdp_interactive.pool.rank import _watchdog_hold
from tests.pool.cuda_standins import FakeCudaTensor, install_nccl_recorder, nccl_entry
from tests.pool.test_cuda_logic import Box, Pair


def _plain_cpu(tensor) -> bool:
    return type(tensor) is torch.Tensor and tensor.device.type == "cpu"


def test_pull_and_call_bring_back_only_plain_cpu_tensors(pool: Pool):
    pool.run(
        "from tests.pool.cuda_standins import FakeCudaTensor\n"
        "from tests.pool.test_cuda_logic import Box, Pair\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Shard, distribute_tensor\n"
        "cuda = FakeCudaTensor(torch.full((2,), float(rank)))\n"
        "assert cuda.is_cuda\n"
        "value = {'pair': Pair(cuda, {cuda}), 'box': Box(cuda), 'plain': torch.ones(1)}\n"
        "mesh = init_device_mesh('cpu', (world_size,))\n"
        "sharded = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])\n"
        "on_meta = [torch.empty(3, device='meta')]\n",
        stream=False,
    )
    for rank, value in enumerate(pool.pull("value")):
        pair, box = value["pair"], value["box"]
        assert type(pair) is Pair and type(box) is Box
        assert _plain_cpu(pair.first) and torch.equal(pair.first, torch.full((2,), float(rank)))
        (in_set,) = pair.second
        assert in_set is pair.first and box.tensor is pair.first  # one tensor, one copy
        assert _plain_cpu(value["plain"])
    # A DTensor comes back as each rank's own shard, no collective run.
    shards = pool.pull("sharded")
    assert all(_plain_cpu(s) for s in shards)
    assert [s.tolist() for s in shards] == [[0.0, 1.0], [2.0, 3.0]]
    with pytest.raises(RankError, match=r"on_meta\[0\] is a tensor on the meta device"):
        pool.pull("on_meta")
    results = pool.call(_device_tensor_in_a_namedtuple, 3.0)
    assert all(type(r) is Pair and _plain_cpu(r.first) for r in results)
    assert [r.first.tolist() for r in results] == [[3.0], [3.0]]
    assert pool.call(lambda: FakeCudaTensor(torch.ones(2)).device.type) == ["cuda", "cuda"]


def _device_tensor_in_a_namedtuple(fill: float) -> Pair:
    return Pair(FakeCudaTensor(torch.tensor([fill])), "second")


#: A cell standing in for a rank that waits for its GPU: the main thread does not take
#: SIGINT until it is done (as a CUDA synchronisation does not), on rank 0 only.
_WAITS_FOR_ITS_GPU = """\
import signal, time
if rank == 0:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        time.sleep(6)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
else:
    time.sleep(6)
"""


def test_a_rank_waiting_for_its_gpu_behind_unfinished_nccl_work_is_reported_blocked(pool: Pool):
    pool.call(
        install_nccl_recorder,
        nccl_entry(4, completed=True),
        nccl_entry(5, completed=False, age_s=40),
        targets=[0],
    )
    with pytest.raises(RankTimeout) as timed_out:
        pool.run(_WAITS_FOR_ITS_GPU, timeout=1.0, stream=False)
    assert "rank 0: in <module>" in str(timed_out.value)
    assert "behind nccl all_reduce #5, unfinished on the GPU for" in timed_out.value.where[0]
    report = pool.interrupt()
    assert report.stopped == [1]
    assert list(report.blocked) == [0]
    assert "behind nccl all_reduce #5" in report.blocked[0]
    assert report.needs_restart and pool.needs_restart
    assert "only a new group frees it" in str(report)
    with pytest.raises(KeyboardInterrupt):
        timed_out.value.wait(30)  # rank 0 takes the signal once its "GPU wait" ends


def test_a_rank_that_stops_but_leaves_nccl_work_queued_needs_a_restart(pool: Pool):
    pool.call(install_nccl_recorder, nccl_entry(9, "broadcast", completed=False), targets=[1])
    with pytest.raises(RankTimeout) as timed_out:
        pool.run("import time\ntime.sleep(30)\n", timeout=1.0, stream=False)
    report = pool.interrupt()
    assert sorted(report.stopped) == [0, 1] and report.blocked == {}
    assert list(report.left_behind) == [1] and "nccl broadcast #9" in report.left_behind[1]
    assert "rank 1: stopped, but left nccl broadcast #9" in str(report)
    assert "NCCL work left queued on a GPU blocks that rank's next collective" in str(report)
    assert report.needs_restart and pool.needs_restart
    with pytest.raises(KeyboardInterrupt):
        timed_out.value.wait(30)


def test_a_breakpoint_holds_every_ranks_nccl_watchdog_while_it_stops(pool: Pool):
    before = pool.call(_watchdog_hold.extended_seconds)
    pool.run(
        "import fsdp_interactive\n"
        "fsdp_interactive.breakpoint(rank=0, commands=['!import time; time.sleep(2)', 'c'])\n"
        "after = True\n",
        stream=False,
    )
    after = pool.call(_watchdog_hold.extended_seconds)
    # Rank 0 stopped and rank 1 waited for about 2 s: both held their watchdog that long.
    assert [a - b >= 2.0 for a, b in zip(after, before, strict=True)] == [True, True]
    assert pool.call(_watchdog_hold.active) == [[], []]


def test_a_breakpoint_on_the_last_line_of_a_cell_lets_the_other_ranks_go(pool: Pool):
    # The debugger never stops there (the cell ends first): the waiting ranks go on.
    pool.run(
        "import fsdp_interactive\nfsdp_interactive.breakpoint(rank=0, commands=['c'])\n",
        timeout=60,
        stream=False,
    )
    assert pool.call(_watchdog_hold.active) == [[], []]


def test_a_post_mortem_session_holds_every_ranks_nccl_watchdog_until_it_ends(pool: Pool):
    with pytest.raises(RankError):
        pool.run("x = 41\nraise ValueError(rank)\n", cell=31, stream=False)
    pool.debug(1, "p x")
    assert pool.call(_watchdog_hold.active) == [["post-mortem"], ["post-mortem"]]
    ended = pool.debug(1, "q")
    assert not ended.active
    assert pool.call(_watchdog_hold.active) == [[], []]
