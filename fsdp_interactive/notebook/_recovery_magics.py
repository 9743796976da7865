"""``%fsdp snapshot``, ``%fsdp journal`` and ``%fsdp recover``: keeping the work through a
fault, from the notebook.

:class:`RecoveryCommands`, a group of :class:`~.magics.FsdpMagics`' subcommands
(:mod:`._magic_session`); ``%fsdp`` dispatches them here. The ranks take snapshots themselves (``fsdp_interactive.snapshot(...)``
in a training loop); these magics take one between cells, show what the pool recorded and
bring the ranks back.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from fsdp_interactive.notebook._magic_io import (
    current_cell_number,
    pool_failures,
    shown_message,
)
from fsdp_interactive.notebook._magic_session import Subcommands
from fsdp_interactive.notebook._snapshot_taking import (
    SnapshotCallFailed,
    persist_snapshot,
    take_snapshot,
)


class RecoveryCommands(Subcommands):
    """The recovery subcommands of ``%fsdp``."""

    @magic_arguments()
    @argument(
        "model", nargs="?", default=None, metavar="MODEL", help="rank variable holding the model"
    )
    @argument(
        "optimizer",
        nargs="?",
        default=None,
        metavar="OPTIMIZER",
        help="rank variable holding the optimizer",
    )
    @argument(
        "--stateful",
        default="",
        metavar="NAMES",
        help="more rank variables to keep: sched,sampler",
    )
    @argument(
        "--step",
        default=None,
        metavar="STEP",
        help="the training step it is taken at: a number, or a rank variable (a StepCounter)",
    )
    @argument("--keep-last", type=int, default=1, metavar="K", help="snapshots kept in host memory")
    @argument(
        "--persist",
        default=None,
        metavar="DIR",
        help="write the snapshot (the newest, without MODEL) to a checkpoint folder on disk",
    )
    def _fsdp_snapshot(self, rest: str) -> None:
        """Keep the ranks' training state in host memory (with a copy on the next host), for
        %fsdp recover; --persist also writes it to a checkpoint folder on disk."""
        args = self.session.parse(self._fsdp_snapshot, rest, "snapshot")
        pool = self.session.require_pool()
        if args.keep_last < 1:
            raise UsageError(f"--keep-last {args.keep_last}: type a number of snapshots >= 1")
        stateful = [name for name in args.stateful.split(",") if name]
        if args.step is not None and not (args.step.isdigit() or args.step.isidentifier()):
            raise UsageError(
                f"--step {args.step!r}: type a step number or the rank variable that counts "
                "steps, e.g. --step 100 or --step step"
            )
        for name in [args.model, args.optimizer, *stateful]:
            if name is not None and not name.isidentifier():
                raise UsageError(f"%fsdp snapshot {name!r}: type rank variable names")
        if args.model is None:
            if args.persist is None:
                raise UsageError(
                    "%fsdp snapshot needs the rank variables to keep: type e.g. "
                    "%fsdp snapshot model optim --stateful sched"
                )
            self._persist(pool, None, args.persist)
            return
        step = None if args.step is None else int(args.step) if args.step.isdigit() else args.step
        try:
            taken = take_snapshot(
                pool,
                args.model,
                args.optimizer,
                step=step,
                keep_last=args.keep_last,
                stateful=stateful,
                cell=current_cell_number(self.session.shell),
                shown=f"%fsdp snapshot {rest.strip()}",
            )
        except SnapshotCallFailed as error:
            hint = "; check the names with %%fsdp print(dir())" if error.undefined_name else ""
            raise UsageError(f"%fsdp snapshot: {error}{hint}") from None
        print(taken.taken_line() if not isinstance(taken, str) else f"took snapshot {taken}")
        if args.persist is not None:
            self._persist(pool, taken if isinstance(taken, str) else taken.id, args.persist)

    @staticmethod
    def _persist(pool: Any, snapshot_id: str | None, folder: str) -> None:
        known = pool.snapshots()
        if snapshot_id is None:
            if not known:
                raise UsageError(
                    "%fsdp snapshot --persist: no snapshot yet; take one with "
                    "%fsdp snapshot MODEL OPTIMIZER --persist DIR"
                )
            snapshot_id = known[-1].id
        try:
            persist_snapshot(pool, snapshot_id, folder)
        except SnapshotCallFailed as error:
            raise UsageError(f"%fsdp snapshot --persist: {error}") from None
        print(
            f"snapshot {snapshot_id} written to {folder} (load it with fsdp_interactive."
            f"checkpoint.load, or %fsdp recover --from {folder})"
        )

    @magic_arguments()
    @argument("--last", type=int, default=None, metavar="N", help="show only the last N calls")
    def _fsdp_journal(self, rest: str) -> None:
        """The cells that built the ranks' state: outcome, time, whether a recovery replays
        them and why, the snapshots they took; then what %fsdp recover would do now."""
        args = self.session.parse(self._fsdp_journal, rest, "journal")
        if self.session.pool is None:
            raise UsageError("no pool; start one with %fsdp start -n 2")
        if args.last is not None and args.last < 1:
            raise UsageError(f"--last {args.last}: type a number of calls >= 1")
        # Read first: each in the row of the call that took it, with what the ranks reported.
        snapshots = self.session.pool.snapshots()
        print(self.session.pool.journal.table(last=args.last))
        if snapshots:
            print("\nsnapshots: " + "; ".join(f"{s.describe()}: {s.holding}" for s in snapshots))
        if snapshots and self.session.pool.state != "stopped":
            print("\nwhat %fsdp recover would do now:")
            try:  # its checks may refuse (a snapshot no host holds): the journal still shows
                self.session.pool.recover(dry_run=True)
            except pool_failures() as error:
                print(f"nothing: it would refuse. {shown_message(error)}")

    @magic_arguments()
    @argument(
        "--from",
        dest="source",
        default=None,
        metavar="ID|DIR",
        help="a snapshot id, or a folder a snapshot was persisted to (%%fsdp snapshot --persist)",
    )
    @argument("--world", type=int, default=None, metavar="N", help="ranks to recover onto")
    @argument("--dry-run", action="store_true", help="print the plan only")
    def _fsdp_recover(self, rest: str) -> None:
        """Back to the last snapshot after a fault (or at any time): a fresh group, the cells
        that build what it restores replayed, the snapshot loaded; --world reshards onto
        another number of ranks, --dry-run prints the plan."""
        args = self.session.parse(self._fsdp_recover, rest, "recover")
        if self.session.pool is None:
            raise UsageError("no pool to recover; start one with %fsdp start -n 2")
        if args.world is not None and args.world < 1:
            raise UsageError(f"--world {args.world}: type a number of ranks >= 1")
        try:
            self.session.pool.recover(args.source, world=args.world, dry_run=args.dry_run)
        except ValueError as error:
            raise UsageError(f"%fsdp recover: {error}") from None
