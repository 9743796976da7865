"""Snapshots on a shared host: what another local user tries, reproduced as that user
(``nobody``, through :mod:`tests.second_user`, staged in ``/dev/shm`` as a real attack
would be), and refused; and what this pool refuses to restore because it did not write it.

* the takeover: another user makes the (predictable) default root first, mode 0777;
* the file modes: root and folders 0700, files 0600, nothing another user can list,
  read or add;
* the planted snapshot with a higher id: not listed, not restored;
* the swapped unfinished folder (a link to a victim's folder, or a link at a file name):
  nothing is ever written through it;
* the traversal manifest (``../../../../dev/zero``): refused, it does not hang;
* the unauthenticated copy: a host's copy whose data and manifest were changed together
  fails the seal and is replaced from a host whose copy holds; with no authentic copy
  left, the restore is refused naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_interactive import checkpoint as ck
from fsdp_interactive.checkpoint._format import _snapshot_seal
from fsdp_interactive.checkpoint._format._checksums import checksum_of
from fsdp_interactive.checkpoint._snapshot import _place, _plan
from tests.checkpoint import _snapshots as s
from tests.checkpoint._common import reseal
from tests.hostile_files import in_time, peak_rss_bytes, put_in_place
from tests.second_user import as_other_user, shared_path

HOSTS = ["host-a", "host-b"]
OTHER_KEY = "0f" * 32


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _make_open_folder(path: str) -> None:
    os.mkdir(path)
    os.chmod(path, 0o777)


def _try(action: Callable[[], Any]) -> str:
    try:
        action()
    except OSError as exc:
        return type(exc).__name__
    return "done"


def test_a_default_root_another_user_made_first_is_answered_with_a_private_one(monkeypatch, caplog):
    assert _place.default_root() == Path(f"/dev/shm/fsdpi-snapshots-{os.getuid()}")
    with shared_path("fsdpi-snapshots-") as root:
        as_other_user(_make_open_folder, str(root))  # first, with rights of their choosing
        monkeypatch.delenv(s.ROOT_ENV, raising=False)
        monkeypatch.setattr(_place, "default_root", lambda: root)
        fallback = _place.fallback_root(root)
        try:
            with caplog.at_level(logging.WARNING, logger=_place.__name__):
                model = _model()
                record = ck.snapshot(model=model, step=1)
            said = caplog.text
            assert f"the default snapshot folder {root} is owned by uid 65534 (nobody)" in said
            assert f"snapshots go to the private folder {fallback} instead" in said
            # the fresh root: this user's private folder, its name unknown to others
            assert fallback.name.startswith(root.name + "-") and fallback != root
            assert stat.S_IMODE(fallback.lstat().st_mode) == 0o700
            assert (fallback / record.id).is_dir()
            assert [r.id for r in ck.list_snapshots()] == [record.id]
            restored = _model(seed=3)
            ck.restore_snapshot(None, {}, objects={"model": restored})
            assert _same(_weights(restored), _weights(model))
            assert os.listdir(root) == []  # nothing of ours went to the squatted folder
        finally:
            shutil.rmtree(fallback, ignore_errors=True)


def test_snapshot_folders_and_files_are_private_to_their_user(monkeypatch):
    with shared_path() as root:
        monkeypatch.setenv(s.ROOT_ENV, str(root))
        monkeypatch.setenv(s.KEY_ENV, s.TEST_KEY)
        record = ck.snapshot(model=_model(), step=1)
        folder = root / record.id
        assert stat.S_IMODE(root.lstat().st_mode) == 0o700
        assert stat.S_IMODE(folder.lstat().st_mode) == 0o700
        files = sorted(folder.iterdir())
        assert {p.name for p in files} == {
            ".metadata", "__0_0.distcp", "manifest.json", "snapshot.json", "seal.json",
        }  # fmt: skip
        assert {stat.S_IMODE(p.lstat().st_mode) for p in files} == {0o600}
        assert all(p.lstat().st_uid == os.geteuid() for p in [root, folder, *files])
        # Another user can neither look in, read, plant nor rename anything.
        tries = as_other_user(
            lambda: {
                "list": _try(lambda: os.listdir(root)),
                "read": _try(lambda: (folder / "__0_0.distcp").read_bytes()),
                "plant": _try(lambda: os.mkdir(root / "s999999")),
                "rename": _try(lambda: os.rename(folder, root / "s999998")),
            }
        )
        assert tries == dict.fromkeys(("list", "read", "plant", "rename"), "PermissionError")


def test_a_planted_snapshot_with_a_higher_id_is_neither_listed_nor_restored(monkeypatch):
    with shared_path() as root, shared_path() as elsewhere:
        monkeypatch.setenv(s.ROOT_ENV, str(elsewhere))
        monkeypatch.setenv(s.KEY_ENV, OTHER_KEY)  # another pool's key
        planted = ck.snapshot(model=_model(seed=9), step=999)
        monkeypatch.setenv(s.ROOT_ENV, str(root))
        monkeypatch.setenv(s.KEY_ENV, s.TEST_KEY)
        genuine_model = _model(seed=1)
        genuine = ck.snapshot(model=genuine_model, step=3)
        # Only this user can write here: the planted folder is a copy of the other pool's.
        shutil.copytree(elsewhere / planted.id, root / "s999999")
        shutil.copytree(elsewhere / planted.id, root / "s999998")
        (root / "s999998" / "seal.json").unlink()
        assert [r.id for r in ck.list_snapshots()] == [genuine.id]
        model = _model(seed=5)
        report = ck.restore_snapshot(None, {}, objects={"model": model})
        assert report.id == genuine.id and report.step == 3
        assert _same(_weights(model), _weights(genuine_model))
        with pytest.raises(ck.CorruptCheckpointError) as refused:
            ck.restore_snapshot("s999999", {}, objects={"model": model})
        assert "not written by this pool" in str(refused.value)
        assert refused.value.file == str(root / "s999999" / "manifest.json")
        with pytest.raises(ck.CorruptCheckpointError, match=r"seal\.json: missing"):
            ck.restore_snapshot("s999998", {}, objects={"model": model})
        assert _same(_weights(model), _weights(genuine_model))  # untouched by the refusals


def _swap(partial: str, victim: str) -> str:
    """What another user tries on the unfinished folder: replace it by a link."""
    return _try(lambda: (os.rename(partial, partial + ".gone"), os.symlink(victim, partial)))


@pytest.mark.parametrize("swapped", ["folder", "file"])
def test_the_unfinished_folder_cannot_be_swapped_for_links(monkeypatch, swapped):
    with shared_path() as root, shared_path("fsdpi-victim-") as victim:
        victim.mkdir()
        os.chmod(victim, 0o777)
        (victim / "__0_0.distcp").write_text("the victim's file")
        monkeypatch.setenv(s.ROOT_ENV, str(root))
        monkeypatch.setenv(s.KEY_ENV, s.TEST_KEY)
        original, tried = _plan.plan, {}

        def plan_then_swap(*args: Any, **kwargs: Any) -> Any:
            plan = original(*args, **kwargs)
            tried["other user"] = as_other_user(_swap, str(plan.partial), str(victim))
            # Were it swapped anyway (here by the owner), nothing is written through a link.
            if swapped == "folder":
                plan.partial.rmdir()
                plan.partial.symlink_to(victim)
            else:
                (plan.partial / "__0_0.distcp").symlink_to(victim / "__0_0.distcp")
            return plan

        monkeypatch.setattr(_plan, "plan", plan_then_swap)
        with pytest.raises(ck.CheckpointError, match="writing snapshot data"):
            ck.snapshot(model=_model(), step=1)
        assert tried["other user"] == "PermissionError"
        assert (victim / "__0_0.distcp").read_text() == "the victim's file"
        assert sorted(p.name for p in victim.iterdir()) == ["__0_0.distcp"]
        assert ck.list_snapshots() == []


def _add_traversal(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    algorithm = manifest.get("checksum", "sha256")
    manifest["files"]["../../../../dev/zero"] = {"size": 0, algorithm: "0"}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_naming_a_path_outside_its_folder_is_refused_not_followed(monkeypatch, tmp_path):
    with shared_path() as root:
        monkeypatch.setenv(s.ROOT_ENV, str(root))
        monkeypatch.setenv(s.KEY_ENV, s.TEST_KEY)
        record = ck.snapshot(model=_model(), step=1)
        folder = root / record.id
        _add_traversal(folder)
        # Sealed again with the pool's key: the entry is refused by its name, not the seal.
        texts = {n: (folder / n).read_text() for n in ("manifest.json", "snapshot.json")}
        seal = _snapshot_seal.seal(bytes.fromhex(s.TEST_KEY), record.id, *texts.values())
        (folder / "seal.json").write_text(seal)
        with pytest.raises(ck.CorruptCheckpointError) as refused:
            in_time(lambda: ck.restore_snapshot(record.id, {}, objects={"model": _model()}))
        assert "'../../../../dev/zero' are not plain file names" in str(refused.value)
    # The same for a disk checkpoint, whatever reads it (sealed again with the user's key).
    model = _model()
    ck.save(tmp_path / "ckpt", model, step=1)
    _add_traversal(tmp_path / "ckpt")
    reseal(tmp_path / "ckpt")
    with pytest.raises(ck.CorruptCheckpointError, match="are not plain file names"):
        in_time(lambda: ck.load(tmp_path / "ckpt", model))
    assert ck.list_checkpoints(tmp_path) == []
    # A data file swapped for a link to /dev/zero is refused as well, not read.
    ck.save(tmp_path / "other", model, step=1)
    data = next((tmp_path / "other").glob("__0_*.distcp"))
    data.unlink()
    data.symlink_to("/dev/zero")
    with pytest.raises(ck.CorruptCheckpointError, match="not a regular file"):
        in_time(lambda: ck.load(tmp_path / "other", model))


def _forge(folder: Path, name: str) -> None:
    """Change a data file and its manifest entry together, as someone without the key
    would: the checksum fits, the seal does not."""
    path = folder / name
    data = bytearray(path.read_bytes())
    data[-8] ^= 0x40
    path.write_bytes(bytes(data))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name][manifest["checksum"]] = checksum_of(bytes(data), manifest["checksum"])
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _restore_forged(root: str, hosts_forged: list[str]) -> dict:
    expected, record = s.take(root, HOSTS)
    dist.barrier()
    if dist.get_rank() == 0:
        for host in hosts_forged:
            _forge(Path(root) / host / record.id, "__1_0.distcp")
    dist.barrier()
    ns = s.cell_namespace(seed=7)
    before = s.exact_state(ns)
    ns["snapshot_id"] = record.id
    try:
        report = s.run_cell(ns, s.RESTORE)
    except ck.CheckpointError as exc:
        return {
            "error": (type(exc).__name__, str(exc), getattr(exc, "file", None)),
            "untouched": s.differences(before, s.exact_state(ns)),
        }
    manifests = {h: (Path(root) / h / record.id / "manifest.json").read_text() for h in HOSTS}
    return {
        "repaired": report.repaired_files,
        "restored": s.differences(expected, s.exact_state(ns)),
        "same_manifests": len(set(manifests.values())) == 1,
    }


def test_a_forged_copy_on_one_host_is_replaced_from_the_authentic_one(ranks2, tmp_path):
    results = ranks2.run(_restore_forged, str(tmp_path), ["host-b"])
    for r in results:
        assert r["restored"] == [] and r["repaired"] == ["__1_0.distcp on host-b"]
        assert r["same_manifests"]  # host-b's description was written again, sealed


def test_a_snapshot_with_no_authentic_copy_is_refused_naming_the_file(ranks2, tmp_path):
    results = ranks2.run(_restore_forged, str(tmp_path), HOSTS)
    assert results[0]["error"] == results[1]["error"]
    kind, message, file = results[0]["error"]
    assert kind == "CorruptCheckpointError" and "not written by this pool" in message
    assert file.endswith("manifest.json")
    assert all(r["untouched"] == [] for r in results)


@pytest.mark.parametrize("how", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", ["manifest.json", "snapshot.json", "seal.json", ".metadata"])
def test_a_fifo_or_dev_zero_in_place_of_a_snapshot_file_is_refused_without_reading(
    monkeypatch, name, how
):
    with shared_path() as root:
        monkeypatch.setenv(s.ROOT_ENV, str(root))
        monkeypatch.setenv(s.KEY_ENV, s.TEST_KEY)
        record = ck.snapshot(model=_model(), step=1)
        put_in_place(root / record.id / name, how)
        peak = peak_rss_bytes()
        assert in_time(ck.list_snapshots) == []  # not listed, and listing does not hang
        # refused: a description that cannot be read leaves the snapshot on no host
        with pytest.raises(ck.CheckpointError, match=record.id):
            in_time(lambda: ck.restore_snapshot(record.id, {}, objects={"model": _model()}))
        assert peak_rss_bytes() - peak < 64 << 20  # nothing was read into memory
