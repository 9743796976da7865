"""Checksums taken ahead of a restore (:mod:`fsdp_interactive.checkpoint._format._prechecked`): a
restore takes a recorded checksum only while the file is provably the one that was hashed, so damage
after the precheck is still caught, and a record that cannot be trusted is ignored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_interactive.checkpoint._format import _manifest, _prechecked
from fsdp_interactive.checkpoint._format._checksums import XXH3_64, checksum_of
from tests.checkpoint import _snapshots as s

FILES = {".metadata", "__0_0.distcp", "__1_0.distcp"}


def _settle() -> None:
    """Let the snapshot's files age past the precheck's settling time."""
    time.sleep(_prechecked.SETTLED_S + 0.05)


def _flip_a_byte(path: Path) -> None:
    """Damage ``path`` in place (same inode, same size), as a stray write would."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_precheck_records_every_settled_file_with_the_manifests_checksum(
    ranks2, tmp_path, monkeypatch
):
    record = ranks2.run(s.take, str(tmp_path))[0][1]
    folder = tmp_path / record.id
    with monkeypatch.context() as patched:
        patched.setattr(_prechecked, "SETTLED_S", 3600.0)  # all of them changed too recently
        assert _prechecked.precheck(folder) == 0
    assert _prechecked.prechecked(folder) == {}

    _settle()
    assert _prechecked.precheck(folder) == len(FILES)
    found = _prechecked.prechecked(folder)
    manifest = _manifest.read_manifest(folder)
    assert set(found) == set(manifest.files) == FILES
    for name, entry in found.items():
        assert (entry.algorithm, entry.digest) == (
            manifest.files[name].algorithm,
            manifest.files[name].digest,
        )
        assert entry.digest == checksum_of((folder / name).read_bytes(), entry.algorithm)
    info = (folder / _prechecked.RECORD_FILE).lstat()
    assert info.st_mode & 0o777 == 0o600 and info.st_uid == os.geteuid()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".prechecked")] == [
        _prechecked.RECORD_FILE
    ]  # no temporary file left


def test_a_restore_takes_the_prechecked_files_and_restores_exactly(ranks2, tmp_path):
    saved = ranks2.run(s.take, str(tmp_path))
    folder = tmp_path / saved[0][1].id
    _settle()
    _prechecked.precheck(folder)
    restored = ranks2.run(s.restore_into_fresh_objects, str(tmp_path), saved[0][1].id)
    for rank, got in enumerate(restored):
        assert s.differences(saved[rank][0], got["state"]) == [], rank
        assert got["report"].prechecked_files == len(FILES)


def test_a_file_damaged_after_the_precheck_is_still_caught_and_repaired(ranks2, tmp_path):
    hosts = ["host-a", "host-b"]
    saved = ranks2.run(s.take, str(tmp_path), hosts)
    snapshot_id = saved[0][1].id
    _settle()
    for host in hosts:
        assert _prechecked.precheck(tmp_path / host / snapshot_id) == len(FILES)
    copy = tmp_path / "host-a" / snapshot_id / "__1_0.distcp"
    _flip_a_byte(copy)
    assert "__1_0.distcp" not in _prechecked.prechecked(copy.parent)  # its stamp moved

    restored = ranks2.run(s.restore_into_fresh_objects, str(tmp_path), snapshot_id, hosts)
    for rank, got in enumerate(restored):
        assert s.differences(saved[rank][0], got["state"]) == [], rank
        assert got["report"].repaired_files == ["__1_0.distcp on host-a"]
        assert got["report"].prechecked_files == 2 * len(FILES) - 1
    assert copy.read_bytes() == (tmp_path / "host-b" / snapshot_id / copy.name).read_bytes()


def test_a_recorded_checksum_other_than_the_manifests_is_hashed_again(ranks2, tmp_path):
    saved = ranks2.run(s.take, str(tmp_path))
    folder = tmp_path / saved[0][1].id
    _settle()
    _prechecked.precheck(folder)
    record = folder / _prechecked.RECORD_FILE
    data = json.loads(record.read_text())
    data["files"]["__0_0.distcp"]["digest"] = "0" * 16
    record.unlink()
    record.write_text(json.dumps(data))
    record.chmod(0o600)
    restored = ranks2.run(s.restore_into_fresh_objects, str(tmp_path), saved[0][1].id)
    for rank, got in enumerate(restored):
        assert s.differences(saved[rank][0], got["state"]) == [], rank
        assert got["report"].prechecked_files == len(FILES) - 1


def _recorded(folder: Path) -> set[str]:
    return set(_prechecked.prechecked(folder))


def _write_record(folder: Path, text: str) -> Path:
    record = folder / _prechecked.RECORD_FILE
    record.unlink(missing_ok=True)
    record.write_text(text)
    record.chmod(0o600)
    return record


def _fake_snapshot(folder: Path) -> None:
    folder.mkdir(mode=0o700)
    files = {}
    for name in ("__0_0.distcp", ".metadata"):
        data = os.urandom(4096)
        (folder / name).write_bytes(data)
        files[name] = {"size": len(data), XXH3_64: checksum_of(data, XXH3_64)}
    manifest = {"checksum": XXH3_64, "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_record_that_is_a_link_writable_by_others_or_damaged_is_ignored(tmp_path):
    folder = tmp_path / "s000001"
    _fake_snapshot(folder)
    _settle()
    assert _prechecked.precheck(folder) == 2
    good = (folder / _prechecked.RECORD_FILE).read_text()
    assert _recorded(folder) == {"__0_0.distcp", ".metadata"}

    elsewhere = tmp_path / "planted.json"
    elsewhere.write_text(good)
    (folder / _prechecked.RECORD_FILE).unlink()
    (folder / _prechecked.RECORD_FILE).symlink_to(elsewhere)
    assert _recorded(folder) == set()  # never read through a link

    _write_record(folder, good).chmod(0o622)
    assert _recorded(folder) == set()  # others could have written it

    for damaged in (good[: len(good) // 2], "[]", '{"files": {"x": 1}}'):
        _write_record(folder, damaged)
        assert _recorded(folder) == set(), damaged

    _write_record(folder, good)
    assert _recorded(folder) == {"__0_0.distcp", ".metadata"}
    (folder / "__0_0.distcp").unlink()
    (folder / "__0_0.distcp").write_bytes(os.urandom(4096))  # replaced: another inode
    assert _recorded(folder) == {".metadata"}


def test_a_precheck_refuses_a_folder_that_is_not_private(tmp_path):
    folder = tmp_path / "s000001"
    _fake_snapshot(folder)
    folder.chmod(0o755)
    with pytest.raises(PermissionError, match="other users can reach it"):
        _prechecked.precheck(folder)
    assert not (folder / _prechecked.RECORD_FILE).exists()


_KILLED_MID_HASH = """
import sys, time
from fsdp_interactive.checkpoint._format import _prechecked
def hash_slowly(fd, algorithm):
    print("hashing", flush=True)
    time.sleep(600)
_prechecked.hash_descriptor = hash_slowly
_prechecked.precheck(sys.argv[1])
"""


def test_a_precheck_killed_mid_hash_leaves_no_record(tmp_path):
    folder = tmp_path / "s000001"
    _fake_snapshot(folder)
    _settle()
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MID_HASH, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "hashing"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert [p.name for p in folder.iterdir() if "prechecked" in p.name] == []
    assert _recorded(folder) == set()
