"""What a snapshot holds and how it comes back: each rank's tensors as raw bytes (no
``torch.save`` framing), each file's XXH3-64 in the manifest (xxhash's own value of the
file; earlier snapshots' CRC-32 still verifies), and a restore at the same world size
that reads the model's shards straight into its parameters, without buffers copied over
afterwards."""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from pathlib import Path

import pytest
import torch.distributed as dist
import xxhash

from fsdp_interactive.checkpoint import _load
from fsdp_interactive.checkpoint._format import _manifest, _safe_reader
from fsdp_interactive.checkpoint._format._checksums import XXH3_64, checksum_of, new_checksum
from fsdp_interactive.fsdp import _fqn_state
from tests.checkpoint import _snapshots as s


def _raw_items(folder: Path, name: str) -> dict:
    """Per item of the file ``name``: whether a tensor item's bytes are just its elements."""
    from fsdp_interactive.checkpoint._format._safe_reader import read_metadata

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
        "digest": xxhash.xxh3_64_hexdigest(own.read_bytes()),
        "metadata_digest": xxhash.xxh3_64_hexdigest((folder / ".metadata").read_bytes()),
        "manifest": json.loads((folder / "manifest.json").read_text()),
        "name": own.name,
    }


def test_each_rank_writes_raw_bytes_with_their_xxh3_in_the_manifest(ranks2, tmp_path):
    results = ranks2.run(_taken, str(tmp_path))
    for r in results:
        manifest = r["manifest"]
        assert manifest["checksum"] == "xxh3_64"
        assert manifest["files"][r["name"]] == {"size": r["file_bytes"], "xxh3_64": r["digest"]}
        assert manifest["files"][".metadata"]["xxh3_64"] == r["metadata_digest"]
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
    metadata_reads: list[str] = []
    original = _fqn_state.apply_model_state
    original_read = _safe_reader.read_metadata

    def counting(model, state, **kwargs):
        applied.append(sorted(state))
        return original(model, state, **kwargs)

    def counting_read(folder, **kwargs):
        metadata_reads.append(str(folder))
        return original_read(folder, **kwargs)

    _fqn_state.apply_model_state = counting
    # Both names the loader reaches it by: its own import and the reader's module.
    _safe_reader.read_metadata = _load.read_metadata = counting_read
    try:
        ns["snapshot_id"] = snapshot_id
        s.run_cell(ns, s.RESTORE)
    finally:
        _fqn_state.apply_model_state = original
        _safe_reader.read_metadata = _load.read_metadata = original_read
    after = [p.to_local().untyped_storage().data_ptr() for p in ns["model"].parameters()]
    return {
        "applied": applied,
        "same_storages": storages == after,
        "state": s.exact_state(ns),
        "metadata_reads": len(metadata_reads),
    }


def test_a_restore_reads_the_models_shards_straight_into_its_parameters_and_metadata_once(
    ranks2, tmp_path
):
    saved = ranks2.run(s.take, str(tmp_path))
    restored = ranks2.run(_restored_in_place, str(tmp_path), saved[0][1].id)
    for rank, r in enumerate(restored):
        assert r["applied"] == [], rank  # nothing copied over from buffers
        assert r["same_storages"]
        # The DCP metadata is unpickled and validated once, not once per read pass.
        assert r["metadata_reads"] == 1, rank
        assert s.differences(saved[rank][0], r["state"]) == [], rank


@pytest.mark.parametrize(
    ("algorithm", "reference"),
    [
        ("xxh3_64", lambda data: xxhash.xxh3_64_hexdigest(data)),
        ("crc32", lambda data: f"{zlib.crc32(data):08x}"),
        ("sha256", lambda data: hashlib.sha256(data).hexdigest()),
    ],
)
def test_every_named_checksum_verifies_a_file_and_catches_one_changed_byte(
    tmp_path, algorithm, reference
):
    # Larger than the read chunk, so the file is hashed in several updates.
    data = bytes(range(256)) * (3 * 4096 + 17)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    record = _manifest.hash_file(path, algorithm)
    assert record == _manifest.FileRecord(len(data), reference(data), algorithm)
    assert _manifest.verify_file(tmp_path, path.name, record) is None
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 1
    path.write_bytes(bytes(damaged))
    assert "checksum mismatch" in _manifest.verify_file(tmp_path, path.name, record)


def test_xxh3_is_the_specified_function():
    # XXH3-64 of no bytes, from the XXH3 specification's test vectors.
    assert checksum_of(b"", XXH3_64) == "2d06800538d394c2"
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        new_checksum("md5")
