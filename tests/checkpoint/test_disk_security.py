"""Disk checkpoints on a shared host: what another local user tries, reproduced as that
user (``nobody``, through :mod:`tests.second_user`, staged in ``/dev/shm``), and refused.

* reading a checkpoint: folders 0700 and files 0600 whatever the umask (``mode=`` opens
  them to the group on request);
* a folder on the way that another user can write or owns: ``save`` refuses it, naming
  the folder and what to do;
* a planted checkpoint with recomputed checksums (and another checkpoint's seal): ``load``
  refuses it, by who can write it and by its seal; ``trusted=True`` and ``trust()`` are
  the user's way to load one they vouch for;
* a FIFO, a link to ``/dev/zero`` or an enormous file in place of each file a load
  opens: refused at once, without reading (no hang, no memory growth).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_interactive import checkpoint as ck
from tests.hostile_files import KINDS, in_time, peak_rss_bytes, put_in_place
from tests.second_user import as_other_user, shared_path


def _model(value: float | None = None, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    if value is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
    return model


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder of this user's in ``/dev/shm`` (mode 0755, so that another user may look
    in): where a checkpoint's own modes are what keeps it private."""
    with shared_path("fsdpi-ckpt-") as path:
        path.mkdir()
        os.chmod(path, 0o755)
        yield path


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.lstat().st_mode) for p in [folder, *folder.iterdir()]}


def _read_all(folder: str) -> dict[str, str]:
    """What another user gets trying to list the checkpoint and read each file."""
    outcome = {}
    try:
        names = os.listdir(folder)
    except OSError as exc:
        return {"list": type(exc).__name__}
    for name in names:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                f.read(1)
            outcome[name] = "read"
        except OSError as exc:
            outcome[name] = type(exc).__name__
    return outcome


def test_checkpoints_are_private_whatever_the_umask_unless_mode_says(shared):
    old = os.umask(0)  # the loosest umask: every mode below is the save's own
    try:
        ck.save(shared / "made" / "below" / "ckpt", _model(), step=1)
        ck.save(shared / "group", _model(), step=1, mode=0o750)
        ck.save(shared / "open", _model(), step=1, mode=0o755)
    finally:
        os.umask(old)
    private = _modes(shared / "made" / "below" / "ckpt")
    assert private.pop("ckpt") == 0o700
    assert set(private) == {
        ".metadata",
        "__0_0.distcp",
        "manifest.json",
        "extra.json",
        "owner-seal.json",
    }
    assert set(private.values()) == {0o600}
    # the folders the save made above the checkpoint are private too
    assert stat.S_IMODE((shared / "made").stat().st_mode) == 0o700
    assert stat.S_IMODE((shared / "made" / "below").stat().st_mode) == 0o700
    group = _modes(shared / "group")
    assert group.pop("group") == 0o750 and set(group.values()) == {0o640}
    # another user reads nothing of a private checkpoint; one saved open they can read
    assert as_other_user(_read_all, str(shared / "made" / "below" / "ckpt")) == {
        "list": "PermissionError"
    }
    assert as_other_user(_read_all, str(shared / "open"))["__0_0.distcp"] == "read"
    with pytest.raises(ValueError, match="mode must be a folder mode"):
        ck.save(shared / "bad", _model(), mode=0o077)


def _open_folder(path: str, mode: int) -> None:
    os.mkdir(path)
    os.chmod(path, mode)


@pytest.mark.parametrize(
    ("who", "mode", "reason"),
    [
        ("other", 0o777, "is owned by uid 65534 (nobody)"),
        ("other", 0o755, "is owned by uid 65534 (nobody)"),
        ("self", 0o777, "can be written by other users (mode 0777) and has no sticky bit"),
        ("self", 0o775, "can be written by other users (mode 0775) and has no sticky bit"),
    ],
)
def test_save_refuses_a_folder_another_user_could_swap_the_checkpoint_in(who, mode, reason):
    with shared_path("fsdpi-shared-ckpts-") as parent:
        if who == "other":
            as_other_user(_open_folder, str(parent), mode)
        else:
            _open_folder(str(parent), mode)
        target = parent / "deep" / "ckpt"
        with pytest.raises(ck.CheckpointPathError) as refused:
            ck.save(target, _model(), step=1)
        message = str(refused.value)
        assert f"refusing to save {target}: the folder {parent} {reason}" in message
        assert "another user could move the checkpoint aside" in message
        assert ("chmod go-w" in message) == (who == "self")
        assert os.listdir(parent) == []  # nothing was made there


def test_a_sticky_shared_folder_is_fine_to_save_in():
    with shared_path("fsdpi-sticky-") as parent:
        _open_folder(str(parent), 0o1777)  # like /tmp: only an entry's owner renames it
        record = ck.save(parent / "ckpt", _model(), step=1)
        assert record.path == str(parent / "ckpt")


def _plant(folder: str, genuine: str) -> None:
    """What another user does: a checkpoint of their own (every weight 7.0) written with
    DCP, a manifest whose SHA-256 sums match it, and the genuine checkpoint's seal."""
    import hashlib

    import torch.distributed.checkpoint as dcp

    os.mkdir(folder)
    state = {"model": {k: torch.full_like(v, 7.0) for k, v in _model().state_dict().items()}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    manifest = json.loads(Path(genuine, "manifest.json").read_text())
    manifest["files"] = {}
    for name in sorted(os.listdir(folder)):
        data = Path(folder, name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    Path(folder, "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    Path(folder, "extra.json").write_text(Path(genuine, "extra.json").read_text())
    shutil.copy(Path(genuine, "owner-seal.json"), Path(folder, "owner-seal.json"))
    os.chmod(folder, 0o755)


def test_a_planted_checkpoint_with_recomputed_checksums_is_refused(shared, tmp_path):
    genuine = shared / "genuine"
    ck.save(genuine, _model(1.0), step=1, mode=0o755)  # readable: the planter copies its seal
    with shared_path("fsdpi-planted-") as planted:
        as_other_user(_plant, str(planted), str(genuine))
        model = _model(0.5)
        before = _weights(model)
        # where another user put it, it is refused for that alone
        with pytest.raises(ck.UntrustedCheckpointError, match="is owned by uid 65534"):
            ck.load(planted, model)
        # copied into a folder of this user's, its seal fails: not written with this key
        copy = tmp_path / "downloaded"
        shutil.copytree(planted, copy)
        with pytest.raises(ck.UntrustedCheckpointError) as refused:
            ck.load(copy, model)
        assert refused.value.file == str(copy / "manifest.json")
        assert "not saved by this user (its seal does not match)" in str(refused.value)
        assert _same(_weights(model), before)  # nothing was loaded
        # the user who vouches for it loads it: once, or sealed for good
        ck.load(copy, model, trusted=True)
        assert all(bool((v == 7.0).all()) for v in model.state_dict().values())
        ck.trust(copy)
        ck.load(copy, _model())
    # the genuine one loads as ever
    model = _model(0.5)
    ck.load(genuine, model)
    assert all(bool((v == 1.0).all()) for v in model.state_dict().values())


def test_a_checkpoint_without_a_seal_or_others_can_write_is_refused_until_trusted(tmp_path):
    ck.save(tmp_path / "old", _model(1.0), step=1)
    (tmp_path / "old" / "owner-seal.json").unlink()  # as saved before checkpoints were sealed
    with pytest.raises(ck.UntrustedCheckpointError, match=r"owner-seal\.json: missing") as refused:
        ck.load(tmp_path / "old", _model())
    assert "trusted=True" in str(refused.value) and "checkpoint.trust" in str(refused.value)
    ck.trust(tmp_path / "old")
    ck.load(tmp_path / "old", _model())
    os.chmod(tmp_path / "old" / "__0_0.distcp", 0o666)
    with pytest.raises(ck.UntrustedCheckpointError, match="can be written by other users"):
        ck.load(tmp_path / "old", _model())
    with pytest.raises(ck.CheckpointPathError, match="refusing to seal"):
        ck.trust(tmp_path / "old")
    ck.load(tmp_path / "old", _model(), trusted=True)


# --------------------------------------------------------------------------- hostile files

_FILES = (".metadata", "__0_0.distcp", "manifest.json", "extra.json", "owner-seal.json")


@pytest.mark.parametrize("how", KINDS)
@pytest.mark.parametrize("name", _FILES)
def test_a_hostile_file_in_place_of_any_a_load_opens_is_refused_without_reading(
    tmp_path, name, how
):
    ck.save(tmp_path / "ckpt", _model(), step=1)
    put_in_place(tmp_path / "ckpt" / name, how)
    model = _model(0.5)
    before = _weights(model)
    peak = peak_rss_bytes()
    # The checks below the seal hold for a trusted checkpoint too (which reads no seal).
    for trusted in (False,) if name == "owner-seal.json" else (False, True):
        with pytest.raises(ck.CorruptCheckpointError) as refused:
            in_time(lambda trusted=trusted: ck.load(tmp_path / "ckpt", model, trusted=trusted))
        assert name in str(refused.value)
    assert peak_rss_bytes() - peak < 64 << 20  # nothing was read into memory
    assert _same(_weights(model), before)
