"""What a snapshot holds and how it comes back: each rank's tensors as raw bytes (no
``torch.save`` framing), each file's CRC-32 in the manifest (zlib's own value of the
file), and a restore at the same world size that reads the model's shards straight into
its parameters, without buffers copied over afterwards."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch.distributed as dist

from fsdp_interactive.fsdp import _fqn_state
from tests.checkpoint import _snapshots as s


def _raw_items(folder: Path, name: str) -> dict:
    """Per item of the file ``name``: whether a tensor item's bytes are just its elements."""
    from fsdp_interactive.checkpoint._safe_reader import read_metadata

    metadata = read_metadata(folder)
    chunks = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        for chunk in getattr(entry, "chunks", []):
            itemsize = entry.properties.dtype.itemsize
            chunks[(fqn, tuple(chunk.offsets))] = math.prod(chunk.sizes) * itemsize
    tensors = raw = covered = 0
    for index, extent in metadata.storage_data.items():
        if extent.relative_path != name:
            continue
        covered += extent.length
        expected = chunks.get((index.fqn, tuple(index.offset or ())))
        if expected is not None:
            tensors += 1
            raw += extent.length == expected
    return {"tensors": tensors, "raw": raw, "covered": covered}


def _taken(root: str) -> dict:
    s.place(root)
    ns = s.cell_namespace(seed=0)
    s.train(ns, 2)
    record = s.run_cell(ns, s.SNAPSHOT)
    folder = Path(root) / record.id
    own = folder / f"__{dist.get_rank()}_0.distcp"
    return {
        "file_bytes": own.stat().st_size,
        "items": _raw_items(folder, own.name),
        "crc": f"{zlib.crc32(own.read_bytes()):08x}",
        "manifest": json.loads((folder / "manifest.json").read_text()),
        "name": own.name,
    }


def test_each_rank_writes_raw_bytes_with_their_crc32_in_the_manifest(ranks2, tmp_path):
    results = ranks2.run(_taken, str(tmp_path))
    for r in results:
        manifest = r["manifest"]
        assert manifest["checksum"] == "crc32"
        assert manifest["files"][r["name"]] == {"size": r["file_bytes"], "crc32": r["crc"]}
        # Every tensor takes exactly its elements' bytes; the items fill the file.
        items = r["items"]
        assert items["tensors"] > 10 and items["raw"] == items["tensors"]
        assert items["covered"] == r["file_bytes"]


def _restored_in_place(root: str, snapshot_id: str) -> dict:
    s.place(root)
    ns = s.cell_namespace(seed=3, lr=0.5)
    s.train(ns, 1)
    storages = [p.to_local().untyped_storage().data_ptr() for p in ns["model"].parameters()]
    applied: list[list[str]] = []
    original = _fqn_state.apply_model_state

    def counting(model, state, **kwargs):
        applied.append(sorted(state))
        return original(model, state, **kwargs)

    _fqn_state.apply_model_state = counting
    try:
        ns["snapshot_id"] = snapshot_id
        s.run_cell(ns, s.RESTORE)
    finally:
        _fqn_state.apply_model_state = original
    after = [p.to_local().untyped_storage().data_ptr() for p in ns["model"].parameters()]
    return {"applied": applied, "same_storages": storages == after, "state": s.exact_state(ns)}


def test_a_restore_reads_the_models_shards_straight_into_its_parameters(ranks2, tmp_path):
    saved = ranks2.run(s.take, str(tmp_path))
    restored = ranks2.run(_restored_in_place, str(tmp_path), saved[0][1].id)
    for rank, r in enumerate(restored):
        assert r["applied"] == [], rank  # nothing copied over from buffers
        assert r["same_storages"]
        assert s.differences(saved[rank][0], r["state"]) == [], rank
