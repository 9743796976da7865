"""A 4-rank pool: placement, collectives, collapsed errors, a crashing rank, clean stop."""

from __future__ import annotations

import signal
import time

import pytest

from fsdp_interactive.pool import Pool, RankDied, RankError
from fsdp_interactive.pool.processes._pids import start_time
from tests.pool.conftest import record, wait_gone

pytestmark = pytest.mark.world4


def _rank_sum() -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return float(value.item())


def test_four_ranks_from_start_to_crash_to_stop(profile_dir, capsys):
    pool = Pool(n=4, devices="cpu", profile_dir=profile_dir, show_progress=False)
    try:
        pool.start()
        record(pool)
        table = capsys.readouterr().out
        assert table.splitlines()[0].split()[:2] == ["rank", "local_rank"]
        assert len(table.strip().splitlines()) == 2 + 4  # header, rule, one row per rank

        assert [r.rank for r in pool.topology] == [0, 1, 2, 3]
        assert [r.local_rank for r in pool.topology] == [0, 1, 2, 3]
        assert pool.call(_rank_sum, timeout=60) == [6.0] * 4

        pool.run("print('step', rank)")
        out = capsys.readouterr().out
        assert all(f"[rank {r}] step {r}\n" in out for r in range(4))

        with pytest.raises(RankError) as info:
            pool.run("raise RuntimeError('odd' if rank % 2 else 'even')", stream=False)
        text = str(info.value)
        assert info.value.ranks == [0, 1, 2, 3]
        assert text.startswith("ranks 0, 1, 2, 3 raised; ranks 0, 2:")
        assert text.count("RuntimeError: even") == 1
        assert "ranks 1, 3: RuntimeError: odd" in text

        survivors = {r.pid: start_time(r.pid) for r in pool.topology if r.rank != 2}
        started = time.monotonic()
        with pytest.raises(RankDied) as died:
            pool.run("import ctypes\nif rank == 2:\n    ctypes.string_at(0)\ndist.barrier()")
        latency = time.monotonic() - started
        err = died.value
        assert err.ranks == [2]
        assert err.exit_codes[2] == -signal.SIGSEGV
        assert "Segmentation fault" in err.log_tails[2]
        assert wait_gone(survivors) == []
        assert pool.state == "broken"
        with capsys.disabled():
            print(
                f"\n[measured] segfault -> RankDied latency (from submitting the cell): {latency:.2f}s"
            )
    finally:
        record(pool)
        pool.stop()
    assert pool.state == "stopped"
    assert wait_gone(pool.launched_pids) == []
