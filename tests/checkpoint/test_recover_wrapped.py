"""``Pool.recover`` after a SIGKILL, on the models users bring (torch FSDP1 flat and with
original parameters under FULL_SHARD and HYBRID_SHARD, DDP, ``torch.compile``, activation
checkpointing, Lightning Fabric, accelerate), on real pools of 2 and 4 ranks: the setup
cell is replayed on a fresh group and every rank gets back, byte for byte, its shards,
optimizer state and random state of the snapshot.

Left out to keep the suite's time (each case starts two groups): torch FSDP1 under
SHARD_GRAD_OP, whose state between steps is FULL_SHARD's (the two differ inside forward
and backward only), and at 4 ranks every wrapping but HYBRID_SHARD. HYBRID_SHARD is the
one whose layout changes with the world size (a mesh of one replica on 2 ranks, of two
replicas sharing each shard on 4); the others shard (or replicate) over all ranks alike
at 2 and 4, where a recovery runs the same code, and the snapshot and load of every
wrapping at 4 ranks is tested in test_wrapped_models.py."""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest

from fsdp_interactive.pool import Pool, RankDied
from tests.checkpoint import _wrappings as w
from tests.frameworks._installed import modules_for, require

SETUP = """
import fsdp_interactive
{framework_imports}from tests.checkpoint._wrappings import build, digest, train
model, optim = build({kind!r})
"""
TRAIN_AND_SNAPSHOT = """
train(model, optim, 0, 2)
fsdp_interactive.snapshot(model=model, optimizer=optim, step=2)
digest(model, optim)
"""
KILL_RANK_1 = "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"


def _pool(size: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    profile = str(tmp_path_factory.mktemp(f"recover-wrapped-{size}"))
    pool = Pool(size, devices="cpu", profile_dir=profile, show_topology=False)
    try:
        yield pool.start()
    finally:
        pool.stop()


@pytest.fixture(scope="module")
def pool2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    yield from _pool(2, tmp_path_factory)


@pytest.fixture(scope="module")
def pool4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    yield from _pool(4, tmp_path_factory)


def _digests(pool: Pool, code: str, **options) -> dict[int, str]:
    results = pool.run(code, stream=False, **options).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


RECOVERED = [kind for kind in w.WRAPPINGS if "SHARD_GRAD_OP" not in kind]
CASES = [pytest.param(kind, 2, id=f"{kind}-2ranks") for kind in RECOVERED] + [
    pytest.param(kind, 4, id=f"{kind}-4ranks", marks=pytest.mark.world4)
    for kind in RECOVERED
    if "HYBRID_SHARD" in kind
]


@pytest.mark.timing
@pytest.mark.parametrize(("kind", "size"), CASES)
def test_recover_after_a_kill_restores_every_rank_bit_for_bit(kind, size, request, capsys):
    require(*modules_for(kind))
    pool: Pool = request.getfixturevalue(f"pool{size}")
    pool.restart()  # a journal of this test's cells only
    # The framework imported at the top of the setup cell: the pool's engine forkers then
    # import it ahead for the groups that restart and recovery start (docs/recovery.md).
    imports = "".join(f"import {module}\n" for module in modules_for(kind))
    pool.run(SETUP.format(kind=kind, framework_imports=imports), cell=1, stream=False)
    at_snapshot = _digests(pool, TRAIN_AND_SNAPSHOT, cell=2, replay=False)
    moved_on = _digests(pool, "train(model, optim, 2, 1)\ndigest(model, optim)", cell=3)
    assert all(moved_on[r] != at_snapshot[r] for r in range(size))
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, cell=4, stream=False)
    report = pool.recover()
    assert report.snapshot is not None and report.snapshot.step == 2
    assert [entry.cell for entry in report.replayed] == [1]
    assert _digests(pool, "digest(model, optim)", journal=False) == at_snapshot
    assert "recovered to the snapshot" in capsys.readouterr().out
