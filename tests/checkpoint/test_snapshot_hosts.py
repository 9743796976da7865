"""Snapshots across hosts without a shared folder: hosts are simulated on this machine by
giving each group of ranks its own snapshot folder and host name
(``FSDPI_SNAPSHOT_ROOT`` / ``FSDPI_SNAPSHOT_HOST``). Every host holds the metadata and
the descriptions, the ring puts each host's files on the next host, and a lost host's
state comes back exactly, resharded, from the copies on the hosts that remain."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fsdp_interactive import checkpoint as ck
from tests.checkpoint import _snapshots as s

DESCRIPTIONS = {".metadata", "manifest.json", "snapshot.json", "seal.json"}


def _published(base: Path, host: str, snapshot_id: str) -> set[str]:
    """The files of ``host``'s published folder of the snapshot (no dot-folders around)."""
    root = base / host
    assert sorted(p.name for p in root.iterdir()) == [snapshot_id], list(root.iterdir())
    return {p.name for p in (root / snapshot_id).iterdir()}


def _data(*ranks: int) -> set[str]:
    return {f"__{r}_0.distcp" for r in ranks}


@pytest.mark.world4
def test_two_hosts_each_keep_the_other_and_a_lost_host_restores_from_the_copy(
    ranks4, ranks2, tmp_path
):
    hosts = ["host-a", "host-a", "host-b", "host-b"]
    saved = ranks4.run(s.take, str(tmp_path), hosts)
    record = saved[0][1]
    assert record.hosts == hosts
    for host in ("host-a", "host-b"):
        assert _published(tmp_path, host, record.id) == DESCRIPTIONS | _data(0, 1, 2, 3)
    manifest = (tmp_path / "host-a" / record.id / "manifest.json").read_text()
    assert manifest == (tmp_path / "host-b" / record.id / "manifest.json").read_text()
    assert set(record.bytes_per_host) == {"host-a", "host-b"}

    shutil.rmtree(tmp_path / "host-b")  # the host is gone, and its memory with it
    restored = ranks2.run(
        s.restore_into_fresh_objects, str(tmp_path), record.id, ["host-a", "host-a"]
    )
    s.check_resharded(saved, restored)
    assert restored[0]["report"].copied_files == 0  # host-a held every file already


@pytest.mark.world4
def test_three_hosts_ring_and_restore_on_two_surviving_hosts(ranks4, ranks2, tmp_path):
    hosts = ["host-a", "host-a", "host-b", "host-c"]
    saved = ranks4.run(s.take, str(tmp_path), hosts)
    record = saved[0][1]
    # Each host keeps its own ranks' files and a copy of the previous host's (a ring).
    assert _published(tmp_path, "host-a", record.id) == DESCRIPTIONS | _data(0, 1, 3)
    assert _published(tmp_path, "host-b", record.id) == DESCRIPTIONS | _data(2, 0, 1)
    assert _published(tmp_path, "host-c", record.id) == DESCRIPTIONS | _data(3, 2)
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "host-b" / record.id).iterdir()}
    assert record.bytes_per_host["host-b"] == sum(sizes[n] for n in _data(0, 1, 2) | {".metadata"})

    shutil.rmtree(tmp_path / "host-b")
    restored = ranks2.run(
        s.restore_into_fresh_objects, str(tmp_path), record.id, ["host-a", "host-c"]
    )
    s.check_resharded(saved, restored)
    report = restored[0]["report"]
    assert report.copied_files == 3  # host-a lacked rank 2's file, host-c ranks 0 and 1's
    assert report.copied_bytes > 0 and report.phases["copy"] >= 0
    # After the restore both hosts hold the whole snapshot, still published and listed.
    for host in ("host-a", "host-c"):
        assert _published(tmp_path, host, record.id) == DESCRIPTIONS | _data(0, 1, 2, 3)


def _list_on(root: str, host: str) -> list[str]:
    s.place(root, host)
    return [r.id for r in ck.list_snapshots()]


def test_a_damaged_copy_is_replaced_from_the_other_host(ranks2, tmp_path):
    hosts = ["host-a", "host-b"]
    saved = ranks2.run(s.take, str(tmp_path), hosts)
    record = saved[0][1]
    copy = tmp_path / "host-a" / record.id / "__1_0.distcp"  # host-a's copy of rank 1's file
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))

    restored = ranks2.run(s.restore_into_fresh_objects, str(tmp_path), record.id, hosts)
    for rank, got in enumerate(restored):
        assert s.differences(saved[rank][0], got["state"]) == [], rank
        assert got["report"].repaired_files == ["__1_0.distcp on host-a"]
    assert copy.read_bytes() == (tmp_path / "host-b" / record.id / "__1_0.distcp").read_bytes()
    assert ranks2.run(_list_on, str(tmp_path / "host-a"), "host-a")[0] == [record.id]


def test_a_host_that_lost_one_file_does_not_list_the_snapshot(ranks2, tmp_path):
    saved = ranks2.run(s.take, str(tmp_path), ["host-a", "host-b"])
    record = saved[0][1]
    (tmp_path / "host-b" / record.id / "__0_0.distcp").unlink()  # the ring copy of rank 0's
    # Listed on the ranks: placing a rank on a host sets its environment.
    assert ranks2.run(_list_on, str(tmp_path / "host-a"), "host-a")[0] == [record.id]
    assert ranks2.run(_list_on, str(tmp_path / "host-b"), "host-b")[0] == []
