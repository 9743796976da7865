"""Files between ranks over gloo (what the ring copy and a restore's completion use), in
small chunks: several files between the same pair at once, an empty file, a file whose
sender's copy is damaged (reported, not renamed into place), both directions at once."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint._format._checksums import checksum_of
from fsdp_interactive.checkpoint._format._manifest import SNAPSHOT_CHECKSUM, FileRecord
from fsdp_interactive.checkpoint._snapshot._transfer import Transfer, exchange


def _exchange(base: str) -> dict:
    rank = dist.get_rank()
    source, target = Path(base) / f"out{rank}", Path(base) / f"in{rank}"
    source.mkdir()
    target.mkdir()
    contents = {
        "big": bytes(range(256)) * 41 + b"tail",  # 10500 bytes: 11 chunks of 1000
        "small": b"x" * 999,
        "empty": b"",
    }
    for name, data in contents.items():
        (source / f"{name}-{rank}").write_bytes(data)
    damaged = FileRecord(
        999, checksum_of(b"what it should have been", SNAPSHOT_CHECKSUM), SNAPSHOT_CHECKSUM
    )
    transfers = []
    for sender in (0, 1):
        for name, data in contents.items():
            record = FileRecord(len(data), checksum_of(data, SNAPSHOT_CHECKSUM), SNAPSHOT_CHECKSUM)
            transfers.append(Transfer(f"{name}-{sender}", record, sender, 1 - sender))
    transfers.append(Transfer("small-0", damaged, 0, 1))  # received as "small-0" again
    result = exchange(transfers, Ranks(), source=source, target=target, chunk_bytes=1000)
    return {
        "files": {p.name: p.read_bytes() for p in sorted(target.iterdir())},
        "problems": result.problems,
        "received": sorted(result.received),
        "sent": result.sent_bytes,
        "expected": contents,
    }


def test_files_cross_in_chunks_and_a_bad_copy_is_reported(ranks2, tmp_path):
    results = ranks2.run(_exchange, str(tmp_path))
    for rank, r in enumerate(results):
        other = 1 - rank
        expected = {f"{n}-{other}": data for n, data in r["expected"].items()}
        assert r["files"] == expected  # every file whole, no temporary name left
        assert r["sent"] == sum(len(d) for d in r["expected"].values()) + (999 if rank == 0 else 0)
    assert results[0]["problems"] == []
    assert (
        len(results[1]["problems"]) == 1
        and "does not match its checksum" in (results[1]["problems"][0])
    )
    assert results[1]["received"] == ["big-0", "empty-0", "small-0"]
