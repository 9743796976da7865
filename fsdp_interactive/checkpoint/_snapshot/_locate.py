"""Finding a snapshot on the hosts of the current group, and making every host hold all
of it (checked) before a restore.

A restore may run on other ranks than the snapshot's: after a host was lost (its ranks
gone, its folder with them), at another world size, or with ranks placed on other hosts.
Each host's folder holds what that host kept. Only snapshots whose seal holds under the
pool's key are found (:mod:`.._format._snapshot_seal`: a folder this pool did not write, or one
altered since, is passed over, and named when asked for); every rank checks the seal of the
description it uses with its own key, also one another host sent. :func:`complete`
checks every copy against that manifest's checksums (each host's files split across that
host's ranks), treats a damaged copy as absent, and sends every host the files it lacks
from a host with a good copy (:mod:`._transfer`, checked on arrival against the same
manifest), so that afterwards ``checkpoint.load`` reads the snapshot on every host from
its own folder.
"""

from __future__ import annotations

import logging
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _checkpoint_folders
from fsdp_interactive.checkpoint._format import _manifest, _snapshot_seal
from fsdp_interactive.checkpoint._format._prechecked import prechecked
from fsdp_interactive.checkpoint._format._snapshot_record import SnapshotRecord
from fsdp_interactive.checkpoint._snapshot import _store
from fsdp_interactive.checkpoint._snapshot._place import (
    ROOT_ENV,
    Hosts,
    host_name,
    private_root,
    rank_of_file,
    root_folder,
)
from fsdp_interactive.checkpoint._snapshot._transfer import Transfer, exchange
from fsdp_interactive.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    SnapshotError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Located:
    """Where the snapshot ``id`` is, as this rank (``rank``) of the current group sees it.

    ``present[r]``: the files (name -> size) of rank ``r``'s host's folder of the snapshot
    (``None`` when that host has no published folder of it); ``described[r]``: whether
    that folder's description passed its seal (the others are rewritten by
    :func:`complete`).
    """

    id: str
    rank: int
    record: SnapshotRecord
    manifest: _manifest.Manifest
    texts: _store.Texts
    hosts: Hosts
    roots: list[str]
    present: list[dict[str, int] | None]
    described: list[bool]

    @property
    def folder(self) -> Path:
        """This rank's host's folder of the snapshot (published, or to be)."""
        return Path(self.roots[self.rank]) / self.id

    def good_size(self, host: str) -> list[str]:
        """The snapshot's files ``host`` holds at their manifest sizes."""
        present = self.present[self.hosts.leader(host)] or {}
        return [n for n, rec in sorted(self.manifest.files.items()) if present.get(n) == rec.size]


def _check_id(snapshot_id: object) -> None:
    if snapshot_id is not None and (
        not isinstance(snapshot_id, str) or _store.id_number(snapshot_id) is None
    ):
        raise ValueError(
            f"snapshot_id must be a snapshot id such as 's000003' (see list_snapshots()) or "
            f"None for the newest, got {snapshot_id!r}"
        )


def _read_texts(folder: Path) -> _store.Texts | None:
    try:
        return _store.read_texts(folder)
    except CheckpointError:
        return None


def _present(folder: Path) -> dict[str, int] | None:
    """The regular files of ``folder`` by size (``None``: no such folder)."""
    if not folder.is_dir() or folder.is_symlink():
        return None
    found = {}
    for child in folder.iterdir():
        if not child.name.startswith(".") or child.name == ".metadata":
            try:
                info = child.lstat()
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                found[child.name] = info.st_size
    return found


def locate(snapshot_id: object, ranks: Ranks) -> Located:
    """Find ``snapshot_id`` (``None``: the newest on any host) on the current group's hosts;
    collective. ``ValueError`` for what is not a snapshot id, :class:`SnapshotError` when
    no host holds it."""
    _check_id(snapshot_id)
    root, key, problem = root_folder(), None, None
    try:
        if private_root(create=False) is not None:
            key = _snapshot_seal.snapshot_key(root, create=False)
    except SnapshotError as exc:
        problem = str(exc)
    ids = _store.sealed_ids(root, key) if key else []
    first = ranks.all_gather((host_name(), str(root), ids, problem))
    refused = [f[3] for f in first if f[3] is not None]
    if refused:
        raise SnapshotError("; ".join(dict.fromkeys(refused)))
    hosts = Hosts(tuple(f[0] for f in first))
    roots = [f[1] for f in first]
    mixed = hosts.mixed_roots(roots)
    if mixed:
        raise SnapshotError(
            f"ranks on one host use different snapshot folders ({mixed}): give every rank "
            f"of a host the same {ROOT_ENV}"
        )
    listed = {host: first[hosts.leader(host)][2] for host in hosts.order}
    if snapshot_id is None:
        every = {i for ids in listed.values() for i in ids}
        if not every:
            raise SnapshotError(
                f"no snapshot on any host ({', '.join(f'{h}: {roots[hosts.leader(h)]}' for h in hosts.order)}); "
                "take one with fsdp_interactive.snapshot(model=..., optimizer=...)"
            )
        snapshot_id = max(every, key=lambda i: _store.id_number(i) or 0)
    folder = root / snapshot_id
    second = ranks.all_gather((_present(folder), _read_texts(folder)))
    present = [s[0] for s in second]
    texts = {r: s[1] for r, s in enumerate(second) if s[1] is not None}
    if not texts:
        raise SnapshotError(
            f"snapshot {snapshot_id} is on no host of this group (snapshots there: {listed}); "
            "restore one of those, or a disk checkpoint with checkpoint.load"
        )
    # Every rank checks, with its own key, every host's texts (also another host's); a
    # host's texts count only when every rank found them authentic, so that every rank
    # takes the same; the first that count are used, the others are written again.
    checked = {r: _unseal(Path(roots[r]) / snapshot_id, found, key) for r, found in texts.items()}
    verdicts = ranks.all_gather({r: isinstance(c, tuple) for r, c in checked.items()})
    described = [all(v.get(r, False) for v in verdicts) for r in range(len(second))]
    good = next((r for r in sorted(texts) if described[r]), None)
    if good is not None:
        manifest, record = checked[good]
        return Located(
            snapshot_id, ranks.rank, record, manifest, texts[good], hosts, roots, present, described
        )
    problems = [c for c in checked.values() if isinstance(c, CheckpointError)]
    refusals = ranks.all_gather([(str(p), getattr(p, "file", None)) for p in problems])[0]
    raise CorruptCheckpointError(
        f"snapshot {snapshot_id}: " + "; ".join(text for text, _ in refusals),
        file=refusals[0][1] if refusals else None,
    )


def _unseal(
    folder: Path, texts: _store.Texts, key: bytes | None
) -> tuple[_manifest.Manifest, SnapshotRecord] | CheckpointError:
    """The manifest and record of ``texts`` if their seal holds under ``key``, else the
    refusal (a rank without a key refuses every one)."""
    if key is None:
        return SnapshotError(
            f"{folder}: this host keeps no snapshot key to check it with; set "
            f"${_snapshot_seal.KEY_ENV} to the key that sealed it"
        )
    try:
        return _store.unseal(folder, texts, key)
    except CheckpointError as exc:
        logger.warning("%s", exc)
        return exc


@dataclass
class Completed:
    """What :func:`complete` did (the same on every rank)."""

    copied_files: int = 0
    copied_bytes: int = 0
    repaired: list[str] = field(default_factory=list)
    #: Files whose checksum a precheck had found good on their host (not hashed again).
    prechecked_files: int = 0
    phases: dict[str, float] = field(default_factory=dict)


def _verify_share(located: Located) -> tuple[list[str], int]:
    """The files this rank checks (its share of its host's) that fail their checksum, and
    how many of its share a precheck had found good
    (:mod:`fsdp_interactive.checkpoint._format._prechecked`: not hashed again)."""
    host = located.hosts.of_rank[located.rank]
    mates = located.hosts.ranks_on(host)
    mine = located.good_size(host)[mates.index(located.rank) :: len(mates)]
    known = prechecked(located.folder)
    bad, taken = [], 0
    for name in mine:
        expected = located.manifest.files[name]
        entry = known.get(name)
        if entry is not None and (entry.algorithm, entry.digest, entry.stamp.size) == (
            expected.algorithm,
            expected.digest,
            expected.size,
        ):
            taken += 1
        elif _manifest.verify_file(located.folder, name, expected) is not None:
            bad.append(name)
    return bad, taken


def _unavailable_error(
    located: Located, lost: list[str], damaged: dict[str, list[str]]
) -> Exception:
    corrupt = sorted(n for n in lost if n in damaged)
    if corrupt:
        where = "; ".join(f"{n} on {', '.join(damaged[n])}" for n in corrupt)
        return CorruptCheckpointError(
            f"snapshot {located.id} is damaged: {where} fail their checksum and no host holds "
            "a good copy; nothing was loaded. Restore an older snapshot (list_snapshots()) "
            "or a disk checkpoint",
            file=corrupt[0],
        )
    owners = sorted({rank_of_file(n) for n in lost} - {None})
    saved_hosts = located.record.hosts
    by = ", ".join(f"rank {r} on {saved_hosts[r]}" for r in owners if r < len(saved_hosts))
    return SnapshotError(
        f"snapshot {located.id} is incomplete on the hosts of this group "
        f"({', '.join(located.hosts.order)}): {', '.join(lost)}"
        + (f" (written by {by})" if by else "")
        + " are on none of them; nothing was loaded. Restore it where those hosts are "
        "reachable, or restore an older snapshot or a disk checkpoint"
    )


def complete(located: Located, ranks: Ranks) -> Completed:
    """Check every host's copy and send every host what it lacks; collective.

    Raises on every rank, before anything is loaded: :class:`CorruptCheckpointError` when a
    file's only copies fail their checksum, :class:`SnapshotError` when a file is on no
    host of the group. A host without the snapshot's folder gets a new one, published
    once complete; a host with one gets the missing files renamed into it one by one.
    """
    done = Completed()
    hosts = located.hosts
    started = time.monotonic()
    shares = ranks.all_gather(_verify_share(located))
    bad = [names for names, _ in shares]
    done.prechecked_files = sum(taken for _, taken in shares)
    damaged: dict[str, list[str]] = {}
    for rank, names in enumerate(bad):
        for name in names:
            damaged.setdefault(name, []).append(hosts.of_rank[rank])
    good = {
        host: set(located.good_size(host)) - {n for r in hosts.ranks_on(host) for n in bad[r]}
        for host in hosts.order
    }
    done.phases["verify"] = time.monotonic() - started

    started = time.monotonic()
    transfers, lost = [], []
    for host in hosts.order:
        lacking = [n for n in sorted(located.manifest.files) if n not in good[host]]
        targets = hosts.ranks_on(host)
        for index, name in enumerate(lacking):
            sources = [h for h in hosts.order if name in good[h]]
            if not sources:
                lost.append(name)
                continue
            senders = hosts.ranks_on(sources[index % len(sources)])
            transfers.append(
                Transfer(name, located.manifest.files[name], senders[index % len(senders)],
                         targets[index % len(targets)])
            )  # fmt: skip
            if name in (located.present[hosts.leader(host)] or {}):
                done.repaired.append(f"{name} on {host}")
    if lost:
        raise _unavailable_error(located, sorted(set(lost)), damaged)
    # Every rank decides alike (from gathered facts): with nothing to copy, describe or
    # publish anywhere, the steps below would only agree that nothing happened.
    leaders = [hosts.leader(host) for host in hosts.order]
    if not transfers and all(
        located.present[r] is not None and located.described[r] for r in leaders
    ):
        done.phases["copy"] = time.monotonic() - started
        return done
    my_host = hosts.of_rank[located.rank]
    fresh = located.present[hosts.leader(my_host)] is None
    target = _checkpoint_folders.partial_path(
        located.folder, ranks.from_rank0(_checkpoint_folders.new_token())
    )
    target = target if fresh else located.folder
    problem = None
    if fresh and hosts.is_leader(located.rank):
        try:
            private_root()
            _store.make_folder(target)
        except (OSError, SnapshotError) as exc:
            problem = f"rank {located.rank}: cannot create {target}: {exc}"
    _agree(ranks, problem, "preparing the folders")
    result = exchange(transfers, ranks, source=located.folder, target=target)
    _agree(ranks, "; ".join(result.problems) or None, "copying files between hosts")
    problem = None
    if hosts.is_leader(located.rank) and (fresh or not located.described[located.rank]):
        try:
            _store.write_descriptions(target, located.texts)
            if fresh:
                _checkpoint_folders.publish(target, located.folder)
        except Exception as exc:
            problem = f"rank {located.rank}: cannot publish {located.folder}: {exc}"
    _agree(ranks, problem, "publishing the completed folders")
    done.copied_files = len(transfers)
    done.copied_bytes = sum(t.size for t in transfers)
    done.phases["copy"] = time.monotonic() - started
    if transfers:
        logger.info(
            "snapshot %s: %d files (%d bytes) copied between hosts, %d damaged copies replaced",
            located.id,
            done.copied_files,
            done.copied_bytes,
            len(done.repaired),
        )
    return done


def _agree(ranks: Ranks, problem: str | None, what: str) -> None:
    problems = [p for p in ranks.all_gather(problem) if p is not None]
    if problems:
        raise SnapshotError(f"restoring the snapshot failed while {what}: " + "; ".join(problems))
