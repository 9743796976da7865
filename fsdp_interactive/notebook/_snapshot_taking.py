"""Taking and persisting a snapshot from the notebook (``%fsdp snapshot``, the snapshot
panel): one call on every rank each, the same code for both.

The ranks keep the snapshot; the kernel only learns its id (and its record from the notice
rank 0 sends). Names are variables of the ranks' namespace: ``model`` and ``optimizer`` are
expressions the panel's :class:`~.rank_model.RankModel` knows, ``stateful`` more variable
names, ``step`` a number or the variable of a :class:`~fsdp_interactive.checkpoint.StepCounter`.

The code these functions run on the ranks is theirs, not the user's: the journal shows the
magic line or the button instead, and a failure is reported by what the ranks raised
(:class:`SnapshotCallFailed`), without a traceback of that code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_TAKEN = "_fsdp_interactive_snapshot"


class SnapshotCallFailed(RuntimeError):
    """The ranks refused or failed to take (or persist) a snapshot; ``errors`` maps each
    rank to what it raised (exception name, message), which the message shows once per
    distinct error, after ``what``; ``undefined_name``: a name given was not defined on
    the ranks."""

    def __init__(self, errors: dict[int, tuple[str, str]], what: str):
        self.errors = dict(errors)
        by_error: dict[tuple[str, str], list[int]] = {}
        for rank in sorted(errors):
            by_error.setdefault(tuple(errors[rank]), []).append(rank)  # type: ignore[arg-type]
        parts = [
            f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: "
            f"{name}: {message}"
            for (name, message), ranks in by_error.items()
        ]
        self.undefined_name = any(name == "NameError" for name, _ in errors.values())
        super().__init__(f"{what}: " + "; ".join(parts))


def take_snapshot(
    pool: Any,
    model: str,
    optimizer: str | None = None,
    *,
    step: int | str | None = None,
    keep_last: int = 1,
    stateful: Sequence[str] = (),
    cell: int | None = None,
    shown: str = "snapshot",
) -> Any:
    """Snapshot on every rank; the kernel's record of it (``pool.snapshots()``'s entry).

    Recorded in the journal as a call that is never replayed (``cell``: the notebook cell
    it comes from), shown there as ``shown`` (the magic line or the button). Raises
    :class:`SnapshotCallFailed` when the ranks raise (a name not defined, no room).
    """
    from fsdp_interactive.pool import RankError

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
        pool.run(code, stream=False, replay=False, cell=cell, journal_text=shown)
        taken = pool.pull(_TAKEN, targets=[0])[0]
    except RankError as error:
        raise SnapshotCallFailed(error.errors, "no snapshot was taken") from None
    finally:
        if pool.running:
            pool.run(f"globals().pop({_TAKEN!r}, None)", stream=False, journal=False)
    return next((s for s in pool.snapshots() if s.id == taken), None) or taken


def persist_snapshot(pool: Any, snapshot_id: str, folder: str) -> None:
    """Write the snapshot ``snapshot_id`` to the checkpoint folder ``folder`` (every rank
    writes what its host holds: the folder must be shared when ranks span hosts);
    :class:`SnapshotCallFailed` when the ranks raise."""
    from fsdp_interactive.pool import RankError

    code = (
        "from fsdp_interactive.checkpoint import persist_snapshot as _fsdpi_persist\n"
        f"{_TAKEN} = _fsdpi_persist({snapshot_id!r}, {folder!r})\n"
        f"del _fsdpi_persist, {_TAKEN}\n"
    )
    try:
        pool.run(code, stream=False, journal=False)
    except RankError as error:
        raise SnapshotCallFailed(error.errors, f"snapshot {snapshot_id} was not written") from None
