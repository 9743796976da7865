"""After every rank wrote its shards (:mod:`.._format._raw_storage`, which took each file's
checksum on the way): the metadata and the ring copies on every host, the descriptions,
the publishing rename per host, rotation, the notice.

Collective over the snapshot's ranks, in this order, each step agreed before the next:

1. every rank shares its files' checksum records; rank 0 shares the DCP metadata;
2. every host's leader writes the metadata into its host's folder, and every rank's
   files are sent to the following host (:mod:`._transfer`), checked on arrival;
3. every host's leader writes ``manifest.json``, ``snapshot.json`` and their seal
   (:mod:`.._format._snapshot_seal`; the same on every host) and renames its folder to the
   snapshot's id: the snapshot is published there;
4. once every host has published, each leader removes its snapshots of the same objects
   beyond ``keep_last`` (never one of other objects); rank 0 publishes a ``{"kind":
   "snapshot", ...}`` notice, naming what every host holds and what was removed.

A step that fails on any rank fails on all, and the leaders remove the unfinished
folders. A rank killed at any point leaves dot-folders (never listed, removed by the
next snapshot) and every earlier snapshot whole; killed between two hosts' renames, the
new snapshot is published on some hosts only, holding every file it needs on those
(the ring copies arrived before any rename), and rotation has not run.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from datetime import datetime, timezone

from fsdp_interactive import _notices, _private_files
from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _checkpoint_folders
from fsdp_interactive.checkpoint._format import _manifest, _snapshot_seal
from fsdp_interactive.checkpoint._format._checksums import checksum_of
from fsdp_interactive.checkpoint._format._raw_storage import METADATA_FILE, RawWriter
from fsdp_interactive.checkpoint._format._snapshot_record import SnapshotRecord
from fsdp_interactive.checkpoint._pipeline import Contents
from fsdp_interactive.checkpoint._snapshot import _store
from fsdp_interactive.checkpoint._snapshot._plan import SnapshotPlan
from fsdp_interactive.checkpoint._snapshot._transfer import Transfer, exchange
from fsdp_interactive.checkpoint.errors import SnapshotError

logger = logging.getLogger(__name__)


def abandon(plan: SnapshotPlan) -> None:
    """Remove this host's unfinished folder of ``plan`` (its leader does; best effort)."""
    if plan.leader:
        shutil.rmtree(plan.partial, ignore_errors=True)


def _agree(ranks: Ranks, problem: str | None, what: str) -> None:
    problems = [p for p in ranks.all_gather(problem) if p is not None]
    if problems:
        raise SnapshotError(f"snapshot failed while {what}: " + "; ".join(problems))


def _spread(plan: SnapshotPlan, ranks: Ranks, gathered: list, metadata: bytes) -> None:
    """Step 2: the metadata on every host, every rank's files on the following host."""
    problem = None
    if plan.leader and plan.rank != 0 and plan.host != plan.hosts.of_rank[0]:
        try:
            _private_files.write_new_file(plan.partial / METADATA_FILE, metadata)
        except Exception as exc:
            problem = f"rank {plan.rank}: cannot write the metadata into {plan.partial}: {exc}"
    transfers = []
    for rank, (records, _, _) in enumerate(gathered):
        receiver = plan.hosts.receiver(rank)
        if receiver is not None:
            for name, rec in sorted(records.items()):
                transfers.append(Transfer(name, rec, rank, receiver))
    done = exchange(transfers, ranks, source=plan.partial, target=plan.partial)
    problems = [p for p in [problem, *done.problems] if p is not None]
    _agree(ranks, "; ".join(problems) or None, "copying files to the following host")
    if transfers:
        logger.info(
            "snapshot %s: rank %d sent %d bytes to the following host, received %d files",
            plan.id,
            plan.rank,
            done.sent_bytes,
            len(done.received),
        )


def _describe(
    plan: SnapshotPlan,
    contents: Contents,
    files: dict[str, _manifest.FileRecord],
    seconds: float,
) -> tuple[_manifest.Manifest, SnapshotRecord]:
    """The manifest and record, built from agreed data only: identical on every rank."""
    manifest = _manifest.Manifest(
        step=plan.step,
        world_size=len(plan.hosts.of_rank),
        created_unix=plan.created,
        created_utc=datetime.fromtimestamp(plan.created, timezone.utc).isoformat(
            timespec="seconds"
        ),
        has_optimizer=contents.has_optimizer,
        files=files,
        stateful=contents.stateful,
    )
    names = sorted(files)
    record = SnapshotRecord(
        id=plan.id,
        step=plan.step,
        created=plan.created,
        world_size=len(plan.hosts.of_rank),
        hosts=list(plan.hosts.of_rank),
        names=plan.names,
        keys=plan.keys,
        bytes_per_host={
            host: sum(files[n].size for n in plan.hosts.files_kept(host, names))
            for host in plan.hosts.order
        },
        seconds=seconds,
        call=plan.call,
        held_at=plan.held_at,
    )
    return manifest, record


def finish(
    plan: SnapshotPlan,
    contents: Contents,
    ranks: Ranks,
    written: RawWriter,
    *,
    blocking: float | None,
) -> SnapshotRecord:
    """Steps 1-4 (see the module), after ``written`` wrote this rank's files.
    ``blocking``: the blocking seconds of a background snapshot (``None``: synchronous,
    the whole call until publishing counts)."""
    try:
        return _finish(plan, contents, ranks, written, blocking)
    except BaseException:
        abandon(plan)
        raise


def _finish(
    plan: SnapshotPlan,
    contents: Contents,
    ranks: Ranks,
    written: RawWriter,
    blocking: float | None,
) -> SnapshotRecord:
    records = {n: r for n, r in written.files.items() if n != METADATA_FILE}
    metadata = written.metadata_bytes if plan.rank == 0 else None
    problem = None
    if plan.rank == 0 and metadata is None:
        problem = f"rank 0: DCP wrote no metadata into {plan.partial}"
    gathered = ranks.all_gather((records, metadata, problem))
    _agree(ranks, problem, "collecting the written files' checksums")
    metadata = gathered[0][1]
    files = {name: rec for own, _, _ in gathered for name, rec in own.items()}
    files[METADATA_FILE] = _manifest.FileRecord(
        len(metadata),
        checksum_of(metadata, _manifest.SNAPSHOT_CHECKSUM),
        _manifest.SNAPSHOT_CHECKSUM,
    )
    _spread(plan, ranks, gathered, metadata)

    # The longest rank's blocking time: the snapshot held training back that long.
    seconds = max(ranks.all_gather(plan.elapsed() if blocking is None else blocking))
    manifest, record = _describe(plan, contents, files, seconds)
    manifest_json, record_json = manifest.to_json(), record.to_json()
    texts = _store.Texts(
        manifest_json,
        record_json,
        _snapshot_seal.seal(plan.key, plan.id, manifest_json, record_json),
    )
    problem = None
    if plan.leader:
        try:
            _store.write_descriptions(plan.partial, texts)
        except Exception as exc:
            problem = f"rank {plan.rank}: cannot write the descriptions in {plan.partial}: {exc}"
    _agree(ranks, problem, "describing the snapshot")
    if plan.leader:
        try:
            _checkpoint_folders.publish(plan.partial, plan.final)
        except Exception as exc:
            problem = f"host {plan.host}: {exc}"
    _agree(ranks, problem, "publishing it (on some hosts it may be published)")

    removed = _store.rotate(plan.root, plan.keep_last, plan.id, plan.key) if plan.leader else []
    # Every rank returns once every host has rotated, knowing what went.
    dropped = sorted(set().union(*ranks.all_gather(removed)))
    record = dataclasses.replace(record, dropped=dropped)
    logger.info(
        "snapshot %s published on %d hosts (%s bytes per host) in %.3fs",
        plan.id,
        len(plan.hosts.order),
        record.bytes_per_host,
        plan.elapsed(),
    )
    if plan.rank == 0:
        # ``held``: what every host keeps after the rotation, so the kernel forgets the rest.
        held = _store.published_ids(plan.root)
        _notices.publish({"kind": "snapshot", **record.to_dict(), "held": held})
    return record
