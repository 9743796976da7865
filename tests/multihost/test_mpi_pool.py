"""A pool whose engines are the ranks of one ``mpiexec`` over ssh, two on each host."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool import Pool, RankDied
from tests.multihost.conftest import left_on_hosts
from tests.multihost.launchers import mpi_pool_kwargs

pytestmark = pytest.mark.multihost


def test_mpi_pool_spans_both_hosts_and_stops_every_rank(testhosts, mpi_env, tmp_path_factory):
    profile_dir = str(tmp_path_factory.mktemp("mpi-profile"))
    pool = Pool(
        4,
        devices="cpu",
        timeout=240,
        show_topology=False,
        **mpi_pool_kwargs(testhosts, 2, profile_dir),
    )
    try:
        pool.start()
        assert [r.host for r in pool.topology] == ["hosta", "hosta", "hostb", "hostb"]
        assert [r.local_rank for r in pool.topology] == [0, 1, 0, 1]
        out = pool.run(
            "import os; print(os.environ['OMPI_COMM_WORLD_RANK'], os.environ['LOCAL_WORLD_SIZE'])",
            stream=False,
        ).stdout
        # engine ids are MPI ranks, and ranks follow engine ids within the host order
        assert [out[r].split() for r in range(4)] == [[str(r), "2"] for r in range(4)]
        results = pool.run(
            "t = torch.tensor([float(rank + 1)]); dist.all_reduce(t); t.item()", stream=False
        ).results
        assert results == {r: "10.0" for r in range(4)}
        # No engine forker runs here: each rank made its host's snapshot root private as
        # it joined (mode 0700, this user's), where a forker makes it at pool start.
        roots = pool.run(ROOT_MODE, stream=False).results
        assert roots == {r: repr(("0o700", True)) for r in range(4)}
        check_checkpoints_need_a_directory_every_host_sees(
            pool, testhosts, tmp_path_factory.mktemp("mpi-checkpoints")
        )
    finally:
        pool.stop()
    assert left_on_hosts(testhosts) == {}


ROOT_MODE = (
    "import os, stat; info = os.lstat(os.environ['FSDPI_SNAPSHOT_ROOT'])\n"
    "oct(stat.S_IMODE(info.st_mode)), info.st_uid == os.geteuid()"
)
SAVE = """
from fsdp_interactive.checkpoint import save, load
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
torch.manual_seed(0)
model = FSDP(torch.nn.Linear(16, 16))
try:
    result = save(PATH, model)
    fresh = FSDP(torch.nn.Linear(16, 16))
    load(PATH, fresh)
    same = torch.equal(fresh.weight.full_tensor(), model.weight.full_tensor())
    print("saved", same)
except Exception as error:
    print("refused", type(error).__name__, error)
"""


def check_checkpoints_need_a_directory_every_host_sees(pool: Pool, hosts, root: Path) -> None:
    """A checkpoint from both hosts into a shared folder; a folder that hostb does not
    share is refused on every rank, naming hostb's ranks, before anything is written."""
    shared = root / "shared" / "step1"
    out = pool.run(SAVE.replace("PATH", repr(str(shared))), stream=False).stdout
    assert {out[r].strip() for r in range(4)} == {"saved True"}, out
    assert list(shared.rglob(".metadata"))
    assert len(list(shared.rglob("*.distcp"))) == 4  # one file per rank, from both hosts

    local = root / "hostb-local"
    hosts.private_dir("hostb", local)
    try:
        out = pool.run(SAVE.replace("PATH", repr(str(local / "step1"))), stream=False).stdout
    finally:
        hosts.release_private_dir("hostb", local)
    for r in range(4):
        line = out[r].strip()
        assert line.startswith("refused CheckpointPathError"), out
        assert "rank 2 on hostb, rank 3 on hostb do not see the folder" in line, line
    assert list(local.iterdir()) == [], "nothing may be written"


def test_a_host_whose_engines_all_vanish_is_named_in_the_error(
    testhosts, mpi_env, tmp_path_factory
):
    profile_dir = str(tmp_path_factory.mktemp("mpi-lost-profile"))
    pool = Pool(
        4,
        devices="cpu",
        timeout=240,
        show_topology=False,
        **mpi_pool_kwargs(testhosts, 2, profile_dir),
    )
    try:
        pool.start()
        assert [r.host for r in pool.topology] == ["hosta", "hosta", "hostb", "hostb"]

        def vanish_hostb() -> None:
            time.sleep(2)
            # every process of the pool on hostb at once: orted, engines, their nannies
            for proc in testhosts.processes_on("hostb"):
                with contextlib.suppress(psutil.Error):
                    proc.kill()

        killer = threading.Thread(target=vanish_hostb)
        killer.start()
        try:
            with pytest.raises(RankDied) as caught:
                pool.run("while True:\n    dist.all_reduce(torch.ones(1))", stream=False)
        finally:
            killer.join()
        error = caught.value
        assert {2, 3} <= set(error.ranks), error
        assert "host hostb lost" in str(error), str(error)
        assert "hosta lost" not in str(error)
    finally:
        pool.stop()
    assert left_on_hosts(testhosts) == {}
