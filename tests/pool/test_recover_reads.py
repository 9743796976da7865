"""``recover --from DIR`` with a hostile file in the folder: each file the recovery's checks
open (in the kernel and on the ranks, before anything ends) replaced by a FIFO or a link
to ``/dev/zero`` is refused at once, and the pool runs on as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_interactive import checkpoint as ck
from fsdp_interactive.pool import Pool, RecoveryError
from tests.hostile_files import in_time, put_in_place


@pytest.fixture(scope="module")
def persisted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A snapshot persisted to disk (what ``%fsdp recover --from DIR`` reads), made here."""
    root = tmp_path_factory.mktemp("root") / "fsdpi-snapshots"
    saved = {k: os.environ.get(k) for k in ("FSDPI_SNAPSHOT_ROOT", "FSDPI_SNAPSHOT_KEY")}
    os.environ["FSDPI_SNAPSHOT_ROOT"] = str(root)
    os.environ["FSDPI_SNAPSHOT_KEY"] = "ab" * 32
    try:
        torch.manual_seed(0)
        ck.snapshot(model=nn.Linear(3, 2), step=1)
        folder = tmp_path_factory.mktemp("persisted") / "ckpt"
        ck.persist_snapshot(None, folder)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})
    return folder


@pytest.mark.parametrize("how", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", ["snapshot.json", "manifest.json", "owner-seal.json", ".metadata"])
def test_a_hostile_file_in_a_recover_from_folder_is_refused_at_once(
    pool: Pool, persisted, tmp_path, name, how
):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(persisted, folder)
    put_in_place(folder / name, how)
    before = pool.topology
    with pytest.raises(RecoveryError) as refused:
        in_time(lambda: pool.recover(from_=str(folder), dry_run=True))
    assert "nothing was changed" in str(refused.value)
    assert pool.running and pool.topology == before
