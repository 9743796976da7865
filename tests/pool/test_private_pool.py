"""A pool on a shared host: its snapshot root is made private at pool start (and a path
another user made first fails the start, left as it is), its private paths and keys are
on no process's command line (``ps`` shows those to every user), and a one-host group's
rendezvous store is a file (mode 0600) in that private root, which no other user
reaches."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.checkpoint._format import _owner_key
from fsdp_interactive.pool import Pool, PoolStartError
from tests.pool.conftest import record, wait_gone
from tests.second_user import as_other_user


def _store_path() -> tuple[str, str]:
    from fsdp_interactive.pool.rank import _bootstrap

    store = _bootstrap.rendezvous_store()
    return type(store).__name__, str(store.path)


def _command_lines(pids: list[int]) -> dict[int, str]:
    lines = {}
    for pid in pids:
        try:
            lines[pid] = "\0".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
    return lines


def test_private_paths_and_the_key_are_on_no_command_line(pool: Pool):
    root, key = pool.snapshot_root, pool._snapshot_key
    processes = pool._processes
    pids = [*pool.launched_pids, *processes.forkers.pids(), processes._reaper.pid]
    lines = _command_lines(pids)
    assert processes.forkers.pids()[0] in lines and processes._reaper.pid in lines
    assert len(lines) >= 5  # controller, forker, reaper, two ranks (and their nannies)
    # Nor the socket folder, the controller's settings or this user's checkpoint key.
    folder = processes.socket_folder
    checkpoint_key = _owner_key.key_hex()
    secrets = [root, key, folder, checkpoint_key, "FSDPI_CONTROLLER", "IPController.ip"]
    assert folder and [pid for pid, line in lines.items() if any(s in line for s in secrets)] == []
    # The ranks hold both, in their environment (readable by this user only).
    seen = pool.run(
        "import os; os.environ['FSDPI_SNAPSHOT_ROOT'], len(os.environ['FSDPI_SNAPSHOT_KEY'])",
        stream=False,
    ).results
    assert set(seen.values()) == {repr((root, 64))}


def test_a_one_host_rendezvous_store_is_a_file_in_the_private_root(pool: Pool):
    root = Path(pool.snapshot_root)
    info = root.lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.geteuid()
    stores = set(pool.call(_store_path))
    assert len(stores) == 1
    ((kind, path),) = stores
    assert kind == "FileStore" and Path(path).parent == root
    assert Path(path).name.startswith(".rendezvous-")
    assert stat.S_IMODE(Path(path).lstat().st_mode) == 0o600  # whatever the umask
    tries = as_other_user(lambda: [_open_error(path), _open_error(str(root))])
    assert tries == ["PermissionError", "PermissionError"]


def _open_error(path: str) -> str:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path).close()
    except OSError as exc:
        return type(exc).__name__
    return "opened"


def _make_open_folder(path: str) -> None:
    os.mkdir(path)
    os.chmod(path, 0o777)
    with open(os.path.join(path, "waiting"), "w") as f:
        f.write("for the victim's snapshots")


def test_a_root_another_user_made_first_fails_the_start_and_is_left_alone(profile_dir):
    pool = Pool(n=2, devices="cpu", profile_dir=profile_dir, show_topology=False, timeout=120)
    root = Path(pool.snapshot_root)
    as_other_user(_make_open_folder, str(root))  # someone who saw or guessed the path
    try:
        with pytest.raises(PoolStartError) as refused:
            pool.start()
        message = str(refused.value)
        assert "refusing the pool's snapshot root" in message and str(root) in message
        assert "exists already" in message and "%fsdp stop" in message
    finally:
        record(pool)
        pool.stop()
        record(pool)
        try:
            assert wait_gone(pool.launched_pids) == []
            # Not ours: neither used nor removed.
            assert sorted(p.name for p in root.iterdir()) == ["waiting"]
            assert root.stat().st_uid == 65534
        finally:
            for child in root.iterdir():
                child.unlink()
            root.rmdir()
