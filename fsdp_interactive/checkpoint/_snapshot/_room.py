"""Whether each host's snapshot folder has room for a new snapshot.

A host needs room for what it will keep of the new snapshot (its ranks' files, the ring
copies of the preceding host's ranks' files, the metadata) while its previous snapshots
still take theirs: they are removed only after the new one is published everywhere.
The sizes are estimated before anything is written, from the bytes each rank captured
plus DCP's per-item framing.

:func:`free_bytes` is the one place that asks the file system; tests replace it to
simulate a full ``/dev/shm`` on machines where a small tmpfs cannot be mounted.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from fsdp_interactive.checkpoint._snapshot._place import ROOT_ENV, Hosts
from fsdp_interactive.checkpoint.errors import SnapshotSpaceError

#: DCP frames every tensor it writes with ``torch.save`` (a small zip archive): an upper
#: bound of that framing per item, and of the metadata and descriptions per snapshot.
PER_ITEM_OVERHEAD = 4096
PER_SNAPSHOT_OVERHEAD = 1 << 20


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer can still write on the file system of ``folder``."""
    return shutil.disk_usage(folder).free


def estimate(tensor_bytes: int, items: int) -> int:
    """Upper bound of the bytes one rank's data files take for ``items`` tensors holding
    ``tensor_bytes`` bytes."""
    return tensor_bytes + PER_ITEM_OVERHEAD * items


def shortage(
    hosts: Hosts, needs: Sequence[int], frees: Sequence[int], roots: Sequence[str]
) -> SnapshotSpaceError | None:
    """The refusal for the first host short of room, or ``None`` when every host has it.

    ``needs[r]`` is rank ``r``'s estimate; ``frees[r]`` and ``roots[r]`` what rank ``r``
    found in its root. The same inputs give the same verdict on every rank.
    """
    short = []
    for host in hosts.order:
        leader = hosts.leader(host)
        needed = sum(needs[r] for r in hosts.kept_ranks(host)) + PER_SNAPSHOT_OVERHEAD
        if frees[leader] < needed:
            short.append((host, roots[leader], needed, frees[leader]))
    if not short:
        return None
    host, folder, needed, free = short[0]
    where = "; ".join(
        f"host {h}: {n / 2**20:.1f} MiB needed in {f}, {v / 2**20:.1f} MiB free"
        for h, f, n, v in short
    )
    return SnapshotSpaceError(
        f"not enough room for a snapshot ({where}); nothing was written and the previous "
        "snapshot is kept. Free memory there (fewer snapshots: keep_last=1, or "
        f"drop_snapshots()), give the folder more room (a larger /dev/shm), or point "
        f"{ROOT_ENV} at a larger tmpfs or a disk folder",
        host=host,
        folder=folder,
        needed=needed,
        free=free,
    )
