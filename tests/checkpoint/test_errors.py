"""Bad input gives the documented errors and leaves the model untouched (one process,
no process group: the same code paths the ranks run, minus the collectives)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from fsdp_interactive import checkpoint as ck
from tests.checkpoint import _common as c


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model = c.plain_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    ck.save(tmp_path / "ckpt", model, opt, step=5)
    return tmp_path / "ckpt"


def _target() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = c.plain_model(1)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _data_file(folder: Path) -> Path:
    return next(folder.glob("__0_*.distcp"))


def _rehash(folder: Path, name: str) -> None:
    """Make the manifest agree with a file we altered on purpose, and seal it again with
    this user's key, as the checkpoint's own user could: what is checked below the seal
    (another user's change fails the seal first: tests/checkpoint/test_disk_security.py)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    c.reseal(folder)


def test_corrupted_file_is_named_and_nothing_is_loaded(saved):
    data = _data_file(saved)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    model, before = _target()
    with pytest.raises(ck.CorruptCheckpointError, match="checksum mismatch") as info:
        ck.load(saved, model)
    assert info.value.file == str(data)
    assert _unchanged(model, before)


def test_truncated_file_is_named_and_nothing_is_loaded(saved):
    data = _data_file(saved)
    data.write_bytes(data.read_bytes()[:100])
    model, before = _target()
    for verify in (True, False):
        with pytest.raises(ck.CorruptCheckpointError, match="truncated") as info:
            ck.load(saved, model, verify=verify)
        assert info.value.file == str(data)
    assert _unchanged(model, before)


def test_unreadable_data_is_reported_with_the_file_even_when_checksums_agree(saved):
    data = _data_file(saved)
    data.write_bytes(b"\0" * data.stat().st_size)
    _rehash(saved, data.name)
    model, before = _target()
    with pytest.raises(ck.CorruptCheckpointError, match=str(data)):
        ck.load(saved, model)
    assert _unchanged(model, before)


def test_missing_metadata_or_manifest(saved, tmp_path):
    (saved / ".metadata").unlink()
    model, before = _target()
    with pytest.raises(ck.CorruptCheckpointError, match=r"\.metadata"):
        ck.load(saved, model)
    (saved / "manifest.json").unlink()
    with pytest.raises(ck.CorruptCheckpointError, match="not a published checkpoint"):
        ck.load(saved, model)
    assert ck.list_checkpoints(saved.parent) == []
    assert _unchanged(model, before)


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_is_never_unpickled_beyond_the_allow_list(saved, tmp_path):
    marker = tmp_path / "pwned"
    (saved / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    _rehash(saved, ".metadata")
    model, before = _target()
    with pytest.raises(ck.CorruptCheckpointError, match="refusing to load global"):
        ck.load(saved, model)
    assert not marker.exists()
    assert _unchanged(model, before)


def test_wrong_model_strict_error_lists_keys_non_strict_reports(saved):
    class Other(c.Net):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(3, 2)
            del self.norm
            self.norm = torch.nn.Identity()

    model = Other()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ck.IncompatibleCheckpointError) as info:
        ck.load(saved, model)
    assert info.value.missing_keys == ["head.bias", "head.weight"]
    assert info.value.unexpected_keys == ["norm.bias", "norm.weight"]
    assert "head.weight" in str(info.value) and "norm.bias" in str(info.value)
    assert _unchanged(model, before)

    report = ck.load(saved, model, strict=False)
    assert report.missing_keys == ["head.bias", "head.weight"]
    assert report.unexpected_keys == ["norm.bias", "norm.weight"]
    assert torch.equal(model.head.weight, before["head.weight"])
    assert not torch.equal(model.inp.weight, before["inp.weight"])


def test_shape_mismatch_always_raises(saved):
    model = c.plain_model(1)
    model.inp = torch.nn.Linear(6, 11)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(ck.IncompatibleCheckpointError, match=r"inp.weight: checkpoint shape"):
            ck.load(saved, model, strict=strict)
    assert _unchanged(model, before)


def test_a_long_shape_mismatch_gives_a_count_and_the_first_few(tmp_path):
    # 14 layers, 28 tensors, every one of another shape: one line, not 28.
    ck.save(tmp_path / "narrow", torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(14))))
    wide = torch.nn.Sequential(*(torch.nn.Linear(5, 5) for _ in range(14)))
    with pytest.raises(ck.IncompatibleCheckpointError) as info:
        ck.load(tmp_path / "narrow", wide)
    assert str(info.value) == (
        "checkpoint does not fit the model: shape mismatch for 28 tensors: "
        "0.bias: checkpoint shape (4,), model shape (5,); "
        "0.weight: checkpoint shape (4, 4), model shape (5, 5); "
        "1.bias: checkpoint shape (4,), model shape (5,); and 25 more; "
        "every one in error.shape_mismatches"
    )
    assert len(info.value.shape_mismatches) == 28


def test_optimizer_mismatches(saved, tmp_path):
    model, before = _target()
    two_groups = torch.optim.Adam(
        [
            {"params": [model.inp.weight]},
            {"params": [p for n, p in model.named_parameters() if n != "inp.weight"]},
        ]
    )
    with pytest.raises(ck.IncompatibleCheckpointError, match="parameter groups do not match"):
        ck.load(saved, model, two_groups)
    assert _unchanged(model, before) and not two_groups.state
    ck.save(tmp_path / "no-optim", c.plain_model(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ck.IncompatibleCheckpointError, match="holds no optimizer state"):
        ck.load(tmp_path / "no-optim", model, opt)
    assert ck.load(tmp_path / "no-optim", model, opt, strict=False).missing_keys == ["optim"]


def test_paths_that_are_files_or_taken(tmp_path, saved):
    model = c.plain_model()
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ck.CheckpointPathError, match="is a file"):
        ck.save(afile, model)
    with pytest.raises(ck.CheckpointPathError, match="is a file"):
        ck.load(afile, model)
    with pytest.raises(ck.CheckpointPathError, match="is a file"):
        ck.list_checkpoints(afile)
    with pytest.raises(ck.CheckpointPathError, match="already exists"):
        ck.save(saved, model)
    with pytest.raises(ck.CheckpointPathError, match="does not exist"):
        ck.load(tmp_path / "nowhere", model)
    ck.save(saved, model, step=9, overwrite=True)
    assert [r.step for r in ck.list_checkpoints(tmp_path)] == [9]


def test_no_write_permission(tmp_path):
    if os.geteuid() == 0:
        # root ignores permission bits; sysfs refuses new entries even to root (EPERM).
        locked = Path("/sys")
        if not locked.is_dir():
            pytest.skip("running as root without /sys: no folder refuses writes here")
        before = sorted(p.name for p in locked.iterdir())
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        os.chmod(locked, 0o500)
        before = []
    with pytest.raises(ck.CheckpointPathError, match=r"not writable|no permission"):
        ck.save(locked / "ckpt", torch.nn.Linear(2, 2))
    assert sorted(p.name for p in locked.iterdir()) == before


def test_overwrite_interrupted_between_renames_restores_the_old_checkpoint(saved):
    # The state an overwrite leaves if it dies after moving the old folder aside.
    aside = saved.parent / f".{saved.name}.replaced-0123456789ab"
    os.rename(saved, aside)
    assert ck.list_checkpoints(saved.parent) == []
    ck.save(saved.parent / "next", c.plain_model(3), step=6)
    assert [r.step for r in ck.list_checkpoints(saved.parent)] == [5, 6]
    assert ck.load(saved, c.plain_model(4), strict=False).step == 5
