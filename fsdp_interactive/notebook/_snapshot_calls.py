"""Taking and persisting a snapshot from the notebook (``%fsdp snapshot``, the snapshot
panel): one call on every rank each, the same code for both.

The ranks keep the snapshot; the kernel only learns its id (and its record from the notice
rank 0 sends). Names are variables of the ranks' namespace: ``model`` and ``optimizer`` are
expressions the panel's :class:`~.rank_model.RankModel` knows, ``stateful`` more variable
names, ``step`` a number or the variable of a :class:`~fsdp_interactive.checkpoint.StepCounter`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_TAKEN = "_fsdp_interactive_snapshot"


def take_snapshot(
    pool: Any,
    model: str,
    optimizer: str | None = None,
    *,
    step: int | str | None = None,
    keep_last: int = 1,
    stateful: Sequence[str] = (),
    cell: int | None = None,
) -> Any:
    """Snapshot on every rank; the kernel's record of it (``pool.snapshots()``'s entry).

    Recorded in the journal as a call that is never replayed (``cell``: the notebook
    cell it comes from).
    """
    keywords = [f"model={model}"]
    keywords += [f"optimizer={optimizer}"] if optimizer else []
    keywords += [f"step={step}"] if step is not None else []
    keywords += [f"keep_last={int(keep_last)}"]
    keywords += [f"{name}={name}" for name in stateful]
    code = (
        "import fsdp_interactive as _fsdpi\n"
        f"{_TAKEN} = _fsdpi.snapshot({', '.join(keywords)}).id\n"
        "del _fsdpi\n"
    )
    try:
        pool.run(code, stream=False, replay=False, cell=cell)
        taken = pool.pull(_TAKEN, targets=[0])[0]
    finally:
        if pool.running:
            pool.run(f"globals().pop({_TAKEN!r}, None)", stream=False, journal=False)
    return next((s for s in pool.snapshots() if s.id == taken), None) or taken


def persist_snapshot(pool: Any, snapshot_id: str, folder: str) -> None:
    """Write the snapshot ``snapshot_id`` to the checkpoint folder ``folder`` (every rank
    writes what its host holds: the folder must be shared when ranks span hosts)."""
    code = (
        "from fsdp_interactive.checkpoint import persist_snapshot as _fsdpi_persist\n"
        f"_fsdpi_persist({snapshot_id!r}, {folder!r})\n"
        "del _fsdpi_persist\n"
    )
    pool.run(code, stream=False, journal=False)
