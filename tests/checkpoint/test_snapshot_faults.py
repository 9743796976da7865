"""A snapshot interrupted at any point leaves the previous one listed and restorable:
an error raised on one rank in the middle (every rank raises, nothing half-published is
listed, no dot-folder stays) and a rank process killed with SIGKILL (the survivors' calls
fail, the dot-folders are never listed and the next snapshot removes them); ``keep_last``
keeps that many on every host. Ranks 0 and 1 sit on two simulated hosts, so the ring
copy and the per-host publishing are part of what is interrupted."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_interactive import checkpoint as ck
from tests.checkpoint import _snapshots as s

HOSTS = ["host-a", "host-b"]


@contextlib.contextmanager
def _fault(point: str, kill: bool) -> Iterator[None]:
    """Make rank 1 fail at ``point`` of the snapshot taken inside: raise there, or SIGKILL
    itself. The real functions are put back afterwards."""
    from fsdp_interactive.checkpoint import _checkpoint_folders
    from fsdp_interactive.checkpoint._format import _raw_storage
    from fsdp_interactive.checkpoint._snapshot import _store, _transfer

    def fail(error: Exception) -> None:
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        raise error

    def write_data(self, plan, planner):
        if kill:
            original[0](self, plan, planner).wait()  # its shard is written, then it dies
        fail(OSError("device error while writing"))

    def receive(self, buffer):
        if kill:
            fail(OSError())
        self.file.close()
        self.file = open(os.devnull, "rb")  # noqa: SIM115 - the next write fails
        original[0](self, buffer)

    where, name, replacement = {
        # the write of this rank's shards
        "write": (_raw_storage.RawWriter, "write_data", write_data),
        # DCP's metadata, written by rank 0 (the fault is on rank 1: its checksum record)
        "checksum": (_raw_storage, "new_checksum", lambda name: fail(OSError("checksum failed"))),
        # receiving the other host's files
        "ring": (_transfer._Incoming, "write", receive),
        # writing manifest.json and snapshot.json
        "describe": (_store, "write_descriptions", lambda *a: fail(OSError("no space left"))),
        # the rename that publishes host-b's folder
        "publish": (_checkpoint_folders, "publish", lambda *a: fail(OSError("rename failed"))),
        # after every host published, before host-b rotated
        "rotate": (_store, "rotate", lambda *a: fail(OSError("cannot remove"))),
    }[point]
    original = [getattr(where, name)]
    setattr(where, name, replacement)
    try:
        yield
    finally:
        setattr(where, name, original[0])


def _interrupted_state() -> dict:
    """The namespace the interrupted snapshot was taken of (the same on every run)."""
    ns = s.cell_namespace(seed=0)
    s.train(ns, 5)
    s.seed_per_rank(7)
    return ns


def _snapshot_with_fault(root: str, point: str, kill: bool) -> str:
    s.place_on_hosts(root, HOSTS)
    ns = _interrupted_state()
    try:
        with _fault(point, kill) if dist.get_rank() == 1 else contextlib.nullcontext():
            record = s.run_cell(ns, s.SNAPSHOT)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"no error ({record.id})"


def _state_at_the_interrupted_snapshot() -> dict:
    return s.exact_state(_interrupted_state())


def _listed_and_dot_folders(root: Path) -> dict[str, tuple[list[str], list[str]]]:
    out = {}
    for host in HOSTS:
        s.place(str(root / host), host)
        listed = [r.id for r in ck.list_snapshots()]
        dots = sorted(p.name for p in (root / host).iterdir() if p.name.startswith("."))
        out[host] = (listed, dots)
    return out


def _restore_previous_exactly(ranks2, root: Path, saved: list) -> None:
    record = saved[0][1]
    restored = ranks2.run(s.restore_into_fresh_objects, str(root), record.id, HOSTS)
    for rank, got in enumerate(restored):
        assert got["report"].id == record.id
        assert s.differences(saved[rank][0], got["state"]) == [], rank


RAISED = ["write", "checksum", "ring", "describe", "publish"]


@pytest.mark.parametrize("point", RAISED)
def test_an_error_in_the_middle_keeps_the_previous_snapshot(ranks2, tmp_path, point):
    saved = ranks2.run(s.take, str(tmp_path), HOSTS)
    previous = saved[0][1].id
    errors = ranks2.run(_snapshot_with_fault, str(tmp_path), point, False)
    assert all(e.startswith(("SnapshotError", "CheckpointError")) for e in errors), errors
    # Every rank raises the same error (each naming its own host's folder).
    same = [e.replace("host-b", "host-a") for e in errors]
    assert same[0] == same[1]
    state = _listed_and_dot_folders(tmp_path)
    if point == "publish":  # host-a renamed before host-b failed: published there only
        assert state["host-a"][0][0] == previous and len(state["host-a"][0]) == 2
        assert state["host-b"] == ([previous], [])
    else:
        assert state == {host: ([previous], []) for host in HOSTS}
    _restore_previous_exactly(ranks2, tmp_path, saved)


KILLED = ["write", "ring", "publish", "rotate"]


@pytest.mark.parametrize("point", KILLED)
def test_a_rank_killed_mid_snapshot_leaves_the_previous_snapshot(ranks2, tmp_path, point):
    saved = ranks2.run(s.take, str(tmp_path), HOSTS)
    previous = saved[0][1].id
    with pytest.raises((RuntimeError, TimeoutError), match=r"died|no answer|failed"):
        ranks2.run(_snapshot_with_fault, str(tmp_path), point, True)
    # The group restarted: rank 1's SIGKILL took its process, the survivor's call failed.
    state = _listed_and_dot_folders(tmp_path)
    for host in HOSTS:
        listed, dots = state[host]
        assert not any(name.startswith(".") for name in listed)
        assert all(".partial-" in d for d in dots), dots
    if point == "rotate":
        # Killed after every host had published it: the new snapshot is whole everywhere
        # (host-a may have rotated the previous one away) and restores exactly.
        newest = state["host-b"][0][-1]
        assert all(state[h][0][-1] == newest != previous for h in HOSTS), state
        expected = ranks2.run(_state_at_the_interrupted_snapshot)
        restored = ranks2.run(s.restore_into_fresh_objects, str(tmp_path), newest, HOSTS)
        for rank, got in enumerate(restored):
            assert s.differences(expected[rank], got["state"]) == [], rank
    else:
        for host in HOSTS:
            assert previous in state[host][0], (host, state)
        if point in ("write", "ring"):  # killed before any host published the new one
            assert all(state[h][0] == [previous] for h in HOSTS), state
        _restore_previous_exactly(ranks2, tmp_path, saved)
    # The next snapshot removes what the killed one left.
    ranks2.run(s.take, str(tmp_path), HOSTS)
    for host in HOSTS:
        assert not [p for p in (tmp_path / host).iterdir() if p.name.startswith(".")]


def _snapshots_kept(root: str, keep: list[int]) -> tuple[list[str], list[list[str]]]:
    s.place_on_hosts(root, HOSTS)
    ns = s.cell_namespace(seed=0)
    taken, listed = [], []
    for keep_last in keep:
        s.train(ns, 1)
        ns["keep"] = keep_last
        record = s.run_cell(ns, "result = fsdp_interactive.snapshot(model=model, keep_last=keep)")
        taken.append(record.id)
        listed.append([r.id for r in ck.list_snapshots()])
    return taken, listed


def test_keep_last_keeps_that_many_on_every_host(ranks2, tmp_path):
    keep = [3, 3, 3, 2, 1]
    per_rank = ranks2.run(_snapshots_kept, str(tmp_path), keep)
    assert per_rank[0] == per_rank[1]  # every host lists the same snapshots
    taken, listed = per_rank[0]
    assert taken == sorted(taken) and len(set(taken)) == len(keep)
    for i, keep_last in enumerate(keep):  # the newest keep_last, the older ones went first
        assert listed[i] == taken[max(0, i + 1 - keep_last) : i + 1], (i, listed)
    for host in HOSTS:
        assert sorted(p.name for p in (tmp_path / host).iterdir()) == taken[-1:]


def _snapshots_of_two_models(root: str) -> dict:
    s.place_on_hosts(root, HOSTS)
    ns = s.cell_namespace(seed=0)
    ns["second"] = ns["fsdp_interactive"].fsdp.FullyShardedDataParallel(
        __import__("torch").nn.Linear(4, 4)
    )
    first = s.run_cell(ns, "result = fsdp_interactive.snapshot(model=model, optimizer=optim)")
    other = s.run_cell(ns, "result = fsdp_interactive.snapshot(model=second)")
    after_other = [r.id for r in ck.list_snapshots()]
    again = s.run_cell(ns, "result = fsdp_interactive.snapshot(model=model, optimizer=optim)")
    return {
        "ids": [first.id, other.id, again.id],
        "dropped": [first.dropped, other.dropped, again.dropped],
        "after_other": after_other,
        "after_again": [r.id for r in ck.list_snapshots()],
        "shown": [repr(first), repr(again)],
        "json": (Path(root) / "host-a" / again.id / "snapshot.json").read_text(),
    }


def test_keep_last_counts_snapshots_of_the_same_objects(ranks2, tmp_path):
    """A snapshot of a second model never drops the only snapshot of the first; a snapshot
    names what it holds and what it dropped, in one short line."""
    per_rank = ranks2.run(_snapshots_of_two_models, str(tmp_path))
    assert per_rank[0]["dropped"] == per_rank[1]["dropped"]  # every rank knows what went
    got = per_rank[0]
    first, other, again = got["ids"]
    assert got["after_other"] == [first, other]  # keep_last=1 each: both kept
    assert got["after_again"] == [other, again]
    assert got["dropped"] == [[], [], [first]]
    assert got["shown"] == [
        f"<snapshot {first}: model, optim>",
        f"<snapshot {again}: model, optim; dropped {first}>",
    ]
    assert "dropped" not in got["json"]
