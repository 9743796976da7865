"""``%fsdp run``, ``%fsdp continue`` and ``%fsdp export``: torchrun scripts into the pool,
and the notebook's session out as a job.

:class:`ScriptCommands`, a group of :class:`~.magics.FsdpMagics`' subcommands
(:mod:`._magic_session`); ``%fsdp`` dispatches them here. ``run`` and ``continue`` show the ranks' output as a ``%%fsdp`` cell
does (rank 0's and every rank's errors, progress bars moving in place), then where the
run stands and what it kept, in the words a notebook user types; ``export`` writes the
script (:mod:`fsdp_interactive.pool._export`) and says how to launch it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from fsdp_interactive.notebook._cell_output import outputs_of, show_outputs
from fsdp_interactive.notebook._magic_io import (
    current_cell_number,
    parse_targets,
    pool_failures,
    shown_as_message,
    stream_default,
)
from fsdp_interactive.notebook._magic_session import Subcommands
from fsdp_interactive.notebook._stream_sink import StreamSink


class ScriptCommands(Subcommands):
    """The script subcommands of ``%fsdp``."""

    @magic_arguments()
    @argument("--stop-at", type=int, default=None, metavar="N", help="pause after step N")
    @argument("--targets", "-t", default="all", help="ranks to run on: 0,2 | 0-1 | all")
    @argument("--cwd", default=None, help="the script's working directory (default: here)")
    @argument("--timeout", type=float, default=None, help="seconds before the hang report")
    @argument("script", help="the torchrun script")
    @argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    def _fsdp_run(self, rest: str) -> None:
        """Run a torchrun script on the ranks as it is (its options go before SCRIPT, its own
        arguments after): torchrun's environment, its init_process_group adopting the pool's
        group; what it built (its globals and its frames' locals) stays on the ranks.
        --stop-at N pauses every rank after its N-th optimizer step; the first interrupt
        pauses it at the next step, the second stops it."""
        args = self.session.parse(self._fsdp_run, rest, "run")
        pool = self.session.require_pool()
        if args.stop_at is not None and args.stop_at < 1:
            raise UsageError(f"--stop-at {args.stop_at}: type a step number >= 1")
        if not os.path.isfile(args.script):
            raise UsageError(
                f"%fsdp run: no script {args.script!r} (working directory {os.getcwd()}); "
                "type its path, e.g. %fsdp run --stop-at 5 train.py --lr 0.1"
            )
        targets = parse_targets(args.targets, pool.world_size)
        ranks = targets if targets is not None else list(range(pool.world_size))
        self._script_call(
            ranks,
            lambda sink: pool.run_script(
                args.script,
                list(args.args),
                targets=targets,
                stop_at=args.stop_at,
                cwd=args.cwd,
                timeout=args.timeout,
                on_output=sink,
                cell=current_cell_number(self.session.shell),
                journal_text=f"%fsdp run {rest.strip()}",
            ),
            hint_options=[a for a in args.args if a in ("--stop-at", "--targets", "--cwd")],
        )

    @magic_arguments()
    @argument("--stop-at", type=int, default=None, metavar="M", help="pause again after step M")
    @argument("--stop", action="store_true", help="end the run at its pause")
    @argument("--timeout", type=float, default=None, help="seconds before the hang report")
    def _fsdp_continue(self, rest: str) -> None:
        """Resume the paused script run, to its end or to the pause after step M (counted
        from the run's start); --stop ends it at its pause."""
        args = self.session.parse(self._fsdp_continue, rest, "continue")
        pool = self.session.require_pool()
        if args.stop and args.stop_at is not None:
            raise UsageError("%fsdp continue: type either --stop-at M or --stop, not both")
        if args.stop_at is not None and args.stop_at < 1:
            raise UsageError(f"--stop-at {args.stop_at}: type a step number >= 1")
        status = pool.script_status()
        if status is None or not status.paused:
            raise UsageError(
                "%fsdp continue: no script run is paused; start one with "
                "%fsdp run --stop-at N SCRIPT"
            )
        if args.stop_at is not None and args.stop_at <= status.steps:
            raise UsageError(
                f"--stop-at {args.stop_at}: {status.name} has already taken {status.steps} "
                f"steps; type a later step, e.g. --stop-at {status.steps + 5}"
            )
        self._script_call(
            list(status.ranks),
            lambda sink: pool.continue_script(
                args.stop_at,
                stop=args.stop,
                timeout=args.timeout,
                on_output=sink,
                cell=current_cell_number(self.session.shell),
                journal_text=f"%fsdp continue {rest.strip()}".strip(),
            ),
        )

    @magic_arguments()
    @argument("path", help="the script to write (a .py file)")
    @argument("--sbatch", action="store_true", help="also write an sbatch file")
    @argument("--nodes", type=int, default=None, help="the job's nodes (default: the pool's hosts)")
    @argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks per node (default: the pool's ranks per host)",
    )
    @argument("--from-snapshot", default=None, metavar="ID", help="load this snapshot instead")
    @argument(
        "--from-checkpoint",
        default=None,
        metavar="DIR",
        help="load this persisted snapshot folder instead",
    )
    @argument("--train", type=int, nargs="+", default=[], metavar="CELL", help="training cells")
    @argument("--dry-run", action="store_true", help="print the plan only")
    def _fsdp_export(self, rest: str) -> None:
        """Write the calls that built the ranks' state, in the order they ran, as a torchrun
        script (and with --sbatch an sbatch file) that holds the same parameters and
        optimizer state bit for bit at the pool's world size; what cannot be carried is listed
        by cell with its reason, and nothing is written."""
        args = self.session.parse(self._fsdp_export, rest, "export")
        pool = self.session.require_pool()
        if args.from_snapshot and args.from_checkpoint:
            raise UsageError(
                "%fsdp export: type either --from-snapshot ID or --from-checkpoint DIR, not both"
            )
        for option, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
            if value is not None and value < 1:
                raise UsageError(f"{option} {value}: type a number >= 1")
        try:
            plan = pool.export(
                args.path,
                sbatch=args.sbatch,
                nodes=args.nodes,
                gpus_per_node=args.gpus_per_node,
                from_snapshot=args.from_snapshot,
                from_checkpoint=args.from_checkpoint,
                train=args.train,
                dry_run=args.dry_run,
            )
        except (TypeError, ValueError) as error:
            raise UsageError(f"%fsdp export: {error}") from None
        except pool_failures() as error:
            refused = getattr(error, "plan", None)
            if refused is not None:
                print("\n".join(refused.lines()))
            raise shown_as_message(error) from None
        print("\n".join(plan.lines()))

    def _script_call(self, ranks: list[int], call: Any, hint_options: list[str] = ()) -> None:
        """Run a script call with the cell's output sink; show its outputs, then its status
        (also when it failed, with what the script kept)."""
        stream = stream_default()
        sink = StreamSink(ranks, all_ranks=False, live=stream)
        try:
            status = call(sink)
        except pool_failures() as error:
            sink.flush()
            show_outputs(outputs_of(sink, None, ranks), None, streamed=stream)
            kept = getattr(error, "script_status", None)
            if kept is not None:
                print("\n".join(kept.lines(notebook=True)))
            if hint_options and "SystemExit: 2" in str(error):
                print(
                    f"note: {', '.join(hint_options)} went to the script: options of %fsdp "
                    "run go before the script's path, e.g. %fsdp run --stop-at 5 train.py"
                )
            raise shown_as_message(error) from None
        sink.flush()
        show_outputs(outputs_of(sink, None, ranks), None, streamed=stream)
        print("\n".join(status.lines(notebook=True)))


def mark_cell(pool: Any, *, local: bool, export: str | None) -> None:
    """Tell the journal what a ``%%fsdp`` cell that just ran was beyond its code:
    ``--local`` (it also runs in the kernel) and ``--export train``."""
    entry = pool.journal.entries[-1] if pool.journal.entries else None
    if entry is None:
        return
    if local:
        pool.journal.mark(entry, "local")
    if export:
        pool.journal.mark(entry, export)
