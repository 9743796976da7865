"""The engine forker's precheck: a real forker hashes a snapshot of its root in a child
and records the checksums a restore then takes
(:mod:`fsdp_interactive.checkpoint._format._prechecked`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from fsdp_interactive.checkpoint._format import _prechecked
from fsdp_interactive.checkpoint._format._checksums import XXH3_64, checksum_of
from fsdp_interactive.pool.processes._forked_launcher import EngineForker, forker_command
from fsdp_interactive.pool.processes._forker_setup import ForkerSetup


@pytest.fixture
def forker_and_root(tmp_path):
    root = tmp_path / "fsdpi-test-root"
    forker = EngineForker(
        str(tmp_path / "forker.log"),
        dict(os.environ),
        command=forker_command(),
        setup=ForkerSetup(str(root)),
    )
    try:
        assert forker.ready.wait(120) and forker.root_made == "created"
        yield forker, root
    finally:
        forker.close()
    assert not root.exists()


def _snapshot(folder: Path, sizes: dict[str, int]) -> dict[str, str]:
    """A snapshot folder as the precheck reads it (a manifest and its files); the
    checksum of each file."""
    folder.mkdir(mode=0o700)
    digests, files = {}, {}
    for name, size in sizes.items():
        data = os.urandom(size)
        (folder / name).write_bytes(data)
        digests[name] = checksum_of(data, XXH3_64)
        files[name] = {"size": size, XXH3_64: digests[name]}
    (folder / "manifest.json").write_text(json.dumps({"checksum": XXH3_64, "files": files}))
    return digests


def _wait_for(condition, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_the_forker_prechecks_a_snapshot_of_its_root_in_a_child(forker_and_root, tmp_path):
    forker, root = forker_and_root
    digests = _snapshot(root / "s000002", {"__0_0.distcp": 3 << 20, ".metadata": 1000})
    time.sleep(_prechecked.SETTLED_S + 0.05)
    forker.precheck("s000002")
    record = root / "s000002" / _prechecked.RECORD_FILE
    assert _wait_for(record.exists), forker.log_tail()
    found = _prechecked.prechecked(root / "s000002")
    assert {name: entry.digest for name, entry in found.items()} == digests
    log = tmp_path / "forker.log"
    assert _wait_for(lambda: "recorded in" in log.read_text()), forker.log_tail()
    assert f"precheck of {root / 's000002'} recorded" in log.read_text()


def test_a_precheck_of_a_path_or_a_missing_snapshot_records_nothing(forker_and_root, tmp_path):
    forker, root = forker_and_root
    outside = tmp_path / "outside"
    _snapshot(outside, {"__0_0.distcp": 100})
    time.sleep(_prechecked.SETTLED_S + 0.05)
    for asked in ("../outside", str(outside), ".s000001", "s000009"):
        forker.precheck(asked)
    log = tmp_path / "forker.log"
    assert _wait_for(lambda: "s000009 failed" in log.read_text()), forker.log_tail()
    text = log.read_text()
    for refused in ("'../outside'", repr(str(outside)), "'.s000001'"):
        assert f"no precheck of {refused}" in text
    assert not (outside / _prechecked.RECORD_FILE).exists()
    # The forker still serves: a precheck of a real snapshot works after them.
    _snapshot(root / "s000001", {"__0_0.distcp": 100})
    time.sleep(_prechecked.SETTLED_S + 0.05)
    forker.precheck("s000001")
    assert _wait_for((root / "s000001" / _prechecked.RECORD_FILE).exists), forker.log_tail()
