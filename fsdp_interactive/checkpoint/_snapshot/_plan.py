"""Before a snapshot writes anything: the hosts, its id, the room on every host, the key
its seal takes, and the unfinished folder on every host. Collective; every rank gets the
same plan (its own folders) or raises the same error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _checkpoint_folders
from fsdp_interactive.checkpoint._format import _snapshot_seal
from fsdp_interactive.checkpoint._snapshot import _room, _store
from fsdp_interactive.checkpoint._snapshot._place import (
    ROOT_ENV,
    Hosts,
    host_name,
    private_root,
    root_folder,
)
from fsdp_interactive.checkpoint.errors import SnapshotError

logger = logging.getLogger(__name__)

#: The highest snapshot number this process used: ids keep growing while the roots are
#: emptied (``drop_snapshots``) within one process.
_last_number = 0


@dataclass(frozen=True)
class SnapshotPlan:
    """One snapshot about to be written, as this rank sees it."""

    id: str
    rank: int
    hosts: Hosts
    root: Path
    partial: Path
    keep_last: int
    step: int | None
    created: float
    started: float
    call: int | None
    names: dict[str, Any]
    keys: list[str]
    #: Every location of the modules it holds when it was taken (see the record).
    held_at: list[str] = field(default_factory=list)
    #: The key the snapshot is sealed with (:mod:`.._format._snapshot_seal`), the same on
    #: every rank.
    key: bytes = b""

    @property
    def final(self) -> Path:
        return self.root / self.id

    @property
    def host(self) -> str:
        return self.hosts.of_rank[self.rank]

    @property
    def leader(self) -> bool:
        """Whether this rank creates, publishes and rotates its host's folders."""
        return self.hosts.is_leader(self.rank)

    def elapsed(self) -> float:
        return time.monotonic() - self.started


class _Seen(NamedTuple):
    """What one rank found before a snapshot."""

    host: str
    root: str
    highest: int
    free: int
    need: int
    error: str | None
    token: str
    key: str  # the key's fingerprint


def _look(root: Path) -> tuple[int, int, bytes, str | None]:
    """(highest number under ``root``, free bytes there, the snapshot key, error) on this
    rank; the root is made a private folder, or refused."""
    try:
        private_root(root)
        key = _snapshot_seal.snapshot_key(root)
        assert key is not None  # made when missing
        return _store.highest_number(root), _room.free_bytes(root), key, None
    except SnapshotError as exc:
        return 0, 0, b"", str(exc)
    except OSError as exc:
        return 0, 0, b"", f"cannot use the snapshot folder {root} ({exc}); set {ROOT_ENV}"


def plan(
    ranks: Ranks,
    *,
    need: int,
    keep_last: int,
    step: int | None,
    created: float,
    started: float,
    call: int | None,
    names: dict[str, Any],
    keys: list[str],
    held_at: list[str] | None = None,
) -> SnapshotPlan:
    """Agree on the snapshot (collective over ``ranks``): ``need`` is this rank's estimate
    of its data files' bytes.

    Raises on every rank: :class:`SnapshotError` when a rank cannot use its root or ranks
    of one host name different roots; :class:`~fsdp_interactive.checkpoint.errors.
    SnapshotSpaceError` when a host lacks room. Nothing is created before both checks
    passed; then each host's leader removes the leftovers of unfinished snapshots under
    its root and creates the new snapshot's dot-folder.
    """
    global _last_number
    root = root_folder()
    highest, free, key, error = _look(root)
    mine = _Seen(
        host_name(),
        str(root),
        highest,
        free,
        need,
        error,
        _checkpoint_folders.new_token(),
        _snapshot_seal.fingerprint(key),
    )
    seen: list[_Seen] = ranks.all_gather((mine, (created, call, names, held_at or [])))
    # What describes the snapshot is rank 0's, so that every host's record is the same.
    created, call, names, held_at = seen[0][1]
    seen = [s for s, _ in seen]
    errors = [f"rank {r}: {s.error}" for r, s in enumerate(seen) if s.error is not None]
    if errors:
        raise SnapshotError("snapshot refused, nothing was written: " + "; ".join(errors))
    if len({s.key for s in seen}) > 1:
        raise SnapshotError(
            "ranks hold different snapshot keys (their hosts' roots keep their own outside a "
            f"pool): give every rank the same ${_snapshot_seal.KEY_ENV} (hex, e.g. from "
            "secrets.token_hex(32)); nothing was written"
        )
    hosts = Hosts(tuple(s.host for s in seen))
    mixed = hosts.mixed_roots([s.root for s in seen])
    if mixed:
        raise SnapshotError(
            f"ranks on one host use different snapshot folders ({mixed}): give every rank "
            f"of a host the same {ROOT_ENV}; nothing was written"
        )
    refusal = _room.shortage(
        hosts, [s.need for s in seen], [s.free for s in seen], [s.root for s in seen]
    )
    if refusal is not None:
        raise refusal
    number = max(_last_number, *(s.highest for s in seen)) + 1
    _last_number = number
    snapshot = _store.snapshot_id(number)
    partial = _checkpoint_folders.partial_path(root / snapshot, seen[0].token)
    made = None
    if hosts.is_leader(ranks.rank):
        try:
            _store.remove_leftovers(root)
            _store.make_folder(partial)
        except OSError as exc:
            made = (
                f"rank {ranks.rank} on {hosts.of_rank[ranks.rank]}: cannot create {partial}: {exc}"
            )
    problems = [p for p in ranks.all_gather(made) if p is not None]
    if problems:
        raise SnapshotError("snapshot refused, nothing was written: " + "; ".join(problems))
    logger.info(
        "snapshot %s (%d ranks on %d hosts): writing to %s",
        snapshot,
        ranks.size,
        len(hosts.order),
        partial,
    )
    return SnapshotPlan(
        id=snapshot,
        rank=ranks.rank,
        hosts=hosts,
        root=root,
        partial=partial,
        keep_last=keep_last,
        step=step,
        created=created,
        started=started,
        call=call,
        names=names,
        keys=keys,
        held_at=list(held_at),
        key=key,
    )
