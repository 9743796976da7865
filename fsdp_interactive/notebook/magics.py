"""``%fsdp``, ``%%fsdp`` and ``%fsdp_auto``: drive the rank pool from a notebook.

Loaded with ``%load_ext fsdp_interactive``.  Option names follow ipyparallel's ``%%px``
where the meaning is the same.  The magics hold one :class:`pool.Pool`
(``current_pool()`` returns it for widgets and scripts).  Every failure on a rank makes the
cell raise, so nbval and papermill see it; bad input raises ``UsageError`` saying what to
type instead.  The kernel never touches CUDA here: memory and devices are asked of the ranks.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from fsdp_interactive.notebook._attach_magics import AttachCommands, is_attached
from fsdp_interactive.notebook._cell_output import GROUPINGS, outputs_of, show_outputs
from fsdp_interactive.notebook._magic_io import (
    cell_hang_notice,
    current_cell_number,
    describe_value,
    parse_targets,
    pool_failures,
    rank_error_class,
    shown_as_message,
    shown_message,
    stream_default,
)
from fsdp_interactive.notebook._magic_session import MagicSession, subcommand
from fsdp_interactive.notebook._magic_usage import line_magic_help, usage_line
from fsdp_interactive.notebook._recovery_magics import RecoveryCommands
from fsdp_interactive.notebook._script_magics import ScriptCommands, mark_cell
from fsdp_interactive.notebook._stream_sink import StreamSink

_PULL_SCRATCH = "_fsdp_interactive_pulled"
_DEFAULT_PULL_LIMIT = 256 * 2**20
_SUBCOMMANDS = (
    "start",
    "stop",
    "restart",
    "status",
    "interrupt",
    "push",
    "pull",
    "trace",
    "debug",
    "snapshot",
    "journal",
    "recover",
    "run",
    "continue",
    "export",
    "stacks",
    "attach",
    "pause",
    "resume",
    "detach",
)

_magics: FsdpMagics | None = None


def _hang_notice_options(where: str, default: str) -> Any:
    """The ``--hang-notice S`` and ``--no-hang-notice`` options of a magic, for ``where``."""

    def add(func: Any) -> Any:
        func = argument("--no-hang-notice", action="store_true", help=f"no hang notice in {where}")(
            func
        )
        return argument(
            "--hang-notice",
            type=float,
            default=None,
            metavar="S",
            help="seconds ranks may wait in a collective other ranks never reach before a live "
            f"notice says so {default}",
        )(func)

    return add


def current_pool() -> Any:
    """The pool that ``%fsdp start`` started in this kernel (None if there is none)."""
    return _magics.pool if _magics is not None else None


def _rank_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: type a rank number, e.g. %fsdp debug -r 1"
        ) from None


@magics_class
class FsdpMagics(Magics):
    """The ``%fsdp`` family; one instance per IPython shell.

    Its own subcommands (start, stop, status, push, pull, trace, debug, ...) are methods
    here; the groups of the others are collaborators given the same :class:`MagicSession`
    (the shell and the pool): :class:`AttachCommands`, :class:`RecoveryCommands`,
    :class:`ScriptCommands`.
    """

    #: The classes whose methods run the subcommands this one does not (see :meth:`_fsdp`).
    GROUPS = (AttachCommands, RecoveryCommands, ScriptCommands)

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session = MagicSession(shell)
        self.attach = AttachCommands(self.session)
        self.recovery = RecoveryCommands(self.session)
        self.scripts = ScriptCommands(self.session)
        self.auto = False
        self._warned_subset = False
        self._last_failed_rank = 0

    @property
    def pool(self) -> Any:
        """The pool (or attached job) the magics drive; ``None`` before ``%fsdp start``."""
        return self.session.pool

    @pool.setter
    def pool(self, pool: Any) -> None:
        self.session.pool = pool

    @classmethod
    def subcommand_function(cls, command: str) -> Any:
        """The function that runs ``%fsdp command`` (its parser documents it)."""
        for owner in (cls, *cls.GROUPS):
            function = subcommand(owner, command)
            if function is not None:
                return function
        raise KeyError(command)

    def _fsdp(self, command: str) -> Any:
        """The bound method that runs ``%fsdp command``."""
        for owner in (self, self.attach, self.recovery, self.scripts):
            method = subcommand(owner, command)
            if method is not None:
                return method
        raise KeyError(command)

    # ------------------------------------------------------------------ %fsdp

    @line_magic
    def fsdp(self, line: str) -> Any:
        # The docstring (what %fsdp? shows) is written from the subcommands' parsers below
        # the class: FSDP_SUMMARY, then every subcommand's usage, description and options.
        words = line.strip().split(None, 1)
        if not words:
            raise UsageError(f"%fsdp needs a command: one of {', '.join(_SUBCOMMANDS)}")
        command, rest = words[0], (words[1] if len(words) > 1 else "")
        if command not in _SUBCOMMANDS:
            raise UsageError(
                f"unknown %fsdp command {command!r}; type one of: "
                + ", ".join(f"%fsdp {c}" for c in _SUBCOMMANDS)
            )
        try:
            return self._fsdp(command)(rest)
        except pool_failures() as error:
            raise shown_as_message(error) from None

    @magic_arguments()
    @argument(
        "-n",
        type=int,
        default=None,
        help="number of ranks (default: one per visible GPU, else 2 CPU ranks)",
    )
    @argument("--devices", default=None, help="CUDA device indices like 0,1 or 'cpu'")
    @argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="the process group's backend (default: nccl on GPU ranks, gloo on CPU ranks)",
    )
    @argument(
        "--engines",
        default="local",
        metavar="LAUNCHER",
        help="ipyparallel launcher: local, ssh, slurm, mpi",
    )
    @argument(
        "--timeout", type=float, default=120.0, metavar="S", help="start-up timeout in seconds"
    )
    @argument("--log-level", choices=("debug", "info"), help="show the pool's log records")
    @argument(
        "--check-collectives",
        action="store_true",
        help="TORCH_DISTRIBUTED_DEBUG=DETAIL: a mismatched collective becomes an error",
    )
    @argument(
        "--flight-recorder",
        type=int,
        default=None,
        metavar="N",
        help="collectives each rank remembers for %%fsdp trace (0: off; default 64)",
    )
    @argument(
        "--recover",
        choices=("auto", "off"),
        default="off",
        help="auto: recover to the last snapshot by itself when a rank dies or a collective wedges",
    )
    @argument(
        "--insecure-network",
        action="store_true",
        help="start even where the pool's channels would cross the network unencrypted",
    )
    @argument(
        "--oversubscribe",
        action="store_true",
        help="start more CPU ranks than this host has cores without a warning",
    )
    @_hang_notice_options("any cell", "(default 30)")
    def _fsdp_start(self, rest: str) -> None:
        """Start the pool: one rank per GPU with NCCL where the engines see GPUs, else CPU
        ranks with gloo (2 unless -n says otherwise); a topology table is shown."""
        args = self.session.parse(self._fsdp_start, rest, "start")
        hang_notice = cell_hang_notice(args.hang_notice, args.no_hang_notice, "%fsdp start")
        if self.pool is not None and self.pool.running:
            raise UsageError(
                f"a pool with {self.pool.world_size} ranks is already running; "
                "type %fsdp restart for a fresh group or %fsdp stop first"
            )
        devices: Any = None
        if args.devices is not None:
            if args.devices == "cpu":
                devices = "cpu"
            else:
                try:
                    devices = [int(d) for d in args.devices.split(",")]
                except ValueError:
                    raise UsageError(
                        f"--devices {args.devices!r}: type device indices like --devices 0,1 "
                        "or --devices cpu"
                    ) from None
        from fsdp_interactive.pool import Pool

        try:
            pool = Pool(
                n=args.n,
                devices=devices,
                backend=args.backend,
                engines=args.engines,
                timeout=args.timeout,
                log_level=args.log_level,
                check_collectives=args.check_collectives,
                flight_recorder=args.flight_recorder,
                recover="auto" if args.recover == "auto" else None,
                insecure_network=args.insecure_network,
                oversubscribe=args.oversubscribe,
                **({} if hang_notice is None else {"hang_notice": hang_notice}),
            )
        except ValueError as error:
            raise UsageError(f"%fsdp start: {error}") from None
        self.pool = pool.start()

    def _fsdp_stop(self, rest: str) -> None:
        """End the pool: its ranks, engines and controller (auto mode goes off)."""
        self.session.no_arguments("stop", rest)
        if is_attached(self.pool):
            return self.attach.detach()
        pool, self.pool = self.pool, None
        self._set_auto(False)
        if pool is None or pool.state == "stopped":
            print("no pool was running")
            return
        ranks, state = pool.world_size, pool.state
        pool.stop()
        print(f"stopped {ranks} ranks" if ranks else f"stopped the pool (it was {state})")

    def _fsdp_restart(self, rest: str) -> None:
        """A fresh process group on fresh ranks, without restarting the kernel; what the
        ranks held is gone (%fsdp recover brings a snapshot back instead)."""
        self.session.no_arguments("restart", rest)
        if self.pool is None:
            raise UsageError("no pool to restart; start one with %fsdp start -n 2")
        self.pool.restart()
        print(
            f"restarted: rank state discarded ({self.pool.world_size} fresh ranks; "
            "define models and data on them again)"
        )

    def _fsdp_interrupt(self, rest: str) -> None:
        """SIGINT to the ranks, saying per rank whether it stopped."""
        self.session.no_arguments("interrupt", rest)
        report = self.session.require_pool().interrupt()
        print("\n".join(report.lines(notebook=True)))

    def _fsdp_status(self, rest: str) -> None:
        """The pool's state (a rank that died since the last cell shows here, with its host
        and signal), its topology and each rank's memory."""
        self.session.no_arguments("status", rest)
        if self.pool is None:
            print("no pool; start one with %fsdp start -n 2")
            return
        if is_attached(self.pool):
            return self.attach.status()
        print("\n".join(self.pool.check().lines(notebook=True)))
        if not self.pool.running:
            return
        from fsdp_interactive.notebook.rank_model import RankModel
        from fsdp_interactive.notebook.render import render_memory, render_topology

        print(render_topology(self.pool.topology).text())
        print()
        try:
            print(render_memory(RankModel(self.pool).memory()).text())
        except pool_failures() as error:
            print(f"memory not asked: {shown_message(error)}")

    @magic_arguments()
    @argument("names", nargs="*", metavar="NAME", help="kernel variables to copy")
    def _fsdp_push(self, rest: str) -> None:
        """Copy kernel variables to every rank, under the same names."""
        names = self.session.parse(self._fsdp_push, rest, "push").names
        if not names:
            raise UsageError("%fsdp push needs variable names: type e.g. %fsdp push lr batch_size")
        pool = self.session.require_pool()
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(
                f"%fsdp push: no variable {', '.join(map(repr, missing))} in the notebook; "
                "define it first (push sends kernel variables to the ranks)"
            )
        pool.push({n: self.shell.user_ns[n] for n in names})
        print(f"pushed {', '.join(names)} to {pool.world_size} ranks")

    @magic_arguments()
    @argument("expr", metavar="EXPR", help="name (or expression) of the value on the ranks")
    @argument("--rank", type=int, default=0, metavar="R", help="rank whose value is taken")
    @argument(
        "--as", dest="as_name", default=None, metavar="NAME", help="kernel variable to store it in"
    )
    @argument(
        "--max-bytes",
        type=int,
        default=_DEFAULT_PULL_LIMIT,
        metavar="B",
        help="size limit in bytes",
    )
    @argument("--force", action="store_true", help="pull whatever the size")
    def _fsdp_pull(self, rest: str) -> None:
        """Copy a rank's value to the kernel; DTensors and FSDP parameters arrive gathered as
        plain CPU tensors, refused above a size limit unless forced."""
        args = self.session.parse(self._fsdp_pull, rest, "pull")
        pool = self.session.require_pool()
        target = args.as_name or args.expr
        if not target.isidentifier():
            raise UsageError(
                f"%fsdp pull {args.expr}: not a plain name; add --as NAME to choose the kernel "
                "variable"
            )
        if not 0 <= args.rank < pool.world_size:
            raise UsageError(
                f"--rank {args.rank} does not exist; the pool has ranks 0..{pool.world_size - 1}"
            )
        try:
            compile(args.expr, "<pull>", "eval")
        except SyntaxError:
            raise UsageError(f"%fsdp pull {args.expr!r}: not a Python expression") from None
        limit = None if args.force else args.max_bytes
        code = (
            "from fsdp_interactive.inspect import plain_copy as _fsdp_interactive_plain_copy\n"
            f"{_PULL_SCRATCH} = _fsdp_interactive_plain_copy({args.expr}, {limit!r}, "
            f"name={args.expr!r})\n"
            "del _fsdp_interactive_plain_copy\n"
        )
        try:
            pool.run(code, stream=False, journal=False)
            value = pool.pull(_PULL_SCRATCH, targets=[args.rank])[0]
        except rank_error_class() as error:
            from fsdp_interactive.inspect import TOO_LARGE

            messages = [message for _, message in error.errors.values()]
            if any(TOO_LARGE in m for m in messages):
                raise UsageError(
                    f"{messages[0]}; type %fsdp pull {args.expr} --force to pull it anyway, or "
                    "raise --max-bytes"
                ) from None
            names = {name for name, _ in error.errors.values()}
            if names == {"TypeError"} and "is a module" in messages[0]:
                raise UsageError(f"%fsdp pull: {messages[0]}") from None
            if names == {"NameError"}:
                raise UsageError(
                    f"%fsdp pull: {messages[0]} on the ranks; check the name with "
                    "%%fsdp print(dir())"
                ) from None
            raise shown_as_message(error) from None
        finally:
            if pool.running:
                pool.run(f"globals().pop({_PULL_SCRATCH!r}, None)", stream=False, journal=False)
        self.shell.user_ns[target] = value
        print(f"{target} <- {describe_value(value)}")

    @magic_arguments()
    @argument("--last", type=int, default=20, metavar="N", help="collectives per process group")
    @argument("--plot", action="store_true", help="draw the timeline instead of the table")
    @argument(
        "--issued-at",
        action="store_true",
        help="add the line that issued each collective (the first time: seconds, ~70 MB a rank)",
    )
    def _fsdp_trace(self, rest: str) -> None:
        """Every rank's recent collectives (torch's flight recorder) and where the ranks
        disagree."""
        args = self.session.parse(self._fsdp_trace, rest, "trace")
        if args.last < 1:
            raise UsageError(f"--last {args.last}: type a number of collectives >= 1")
        trace = self.session.require_pool().trace(last=args.last, issued_at=args.issued_at)
        if not args.plot:
            print(trace)
            return
        from IPython.display import Image, display

        from fsdp_interactive.notebook._format import figure_png
        from fsdp_interactive.notebook.trace_plot import trace_figure

        print("\n".join(trace.findings or ["the ranks agree on every recorded collective"]))
        display(Image(figure_png(trace_figure(trace, last=args.last))))

    @magic_arguments()
    @argument(
        "-r",
        "--rank",
        type=_rank_number,
        default=None,
        help="the rank whose failure to debug (default: the lowest rank that failed)",
    )
    @argument(
        "command",
        nargs=argparse.REMAINDER,
        help="one pdb command to run (p x, up, where, ...); without one, a prompt until q",
    )
    def _fsdp_debug(self, rest: str) -> None:
        """pdb on the frame where the last %%fsdp cell failed on a rank."""
        args = self.session.parse(self._fsdp_debug, rest, "debug")
        pool = self.session.require_pool()
        rank = self._last_failed_rank if args.rank is None else args.rank
        if not 0 <= rank < pool.world_size:
            raise UsageError(
                f"%fsdp debug -r {rank}: no such rank; the pool has ranks 0..{pool.world_size - 1}"
            )
        from fsdp_interactive.pool import PoolError

        command = " ".join(args.command) or None
        try:
            output = pool.debug(rank, command)
        except PoolError as error:
            raise UsageError(f"%fsdp debug: {error}") from None
        print(output, end="" if output.endswith("\n") or not output else "\n")
        if command is not None:
            return
        prompt = f"(rank {rank} Pdb) "
        while output.active:
            try:
                line = input(prompt)
            except EOFError:
                break
            output = pool.debug(rank, line)
            print(output, end="" if output.endswith("\n") or not output else "\n")

    # ------------------------------------------------------------------ %%fsdp

    @magic_arguments("%fsdp")
    @argument(
        "--targets", "-t", default="all", metavar="RANKS", help="ranks to run on: 0,2 | 0-1 | all"
    )
    @argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds before the hang watchdog reports",
    )
    @argument(
        "--stream",
        dest="stream",
        action="store_true",
        default=None,
        help="show output while the ranks run (default)",
    )
    @argument("--no-stream", dest="stream", action="store_false", help="show output at the end")
    @argument(
        "--group-outputs",
        choices=GROUPINGS,
        default=None,
        help="show every rank's output grouped by rank, type or order",
    )
    @argument("--local", action="store_true", help="also run the cell in the kernel")
    @argument(
        "-o",
        "--out",
        default=None,
        metavar="NAME",
        help="store the run's result (or timeout) under NAME",
    )
    @argument(
        "--native",
        action="store_true",
        help="on --timeout, add each rank's native (C/C++) frames (py-spy)",
    )
    @argument(
        "--replay",
        action="store_true",
        help="%%fsdp recover always runs this cell again (it changes an object in a way "
        "the snapshot does not hold, e.g. registers a hook the slice cannot see)",
    )
    @argument(
        "--no-replay",
        action="store_true",
        help="%%fsdp recover never runs this cell again",
    )
    @argument(
        "--export",
        choices=("train",),
        default=None,
        help="train: %%fsdp export runs this cell as a training cell (after a restored state)",
    )
    @_hang_notice_options("this cell", "(default: the pool's, 30)")
    @cell_magic("fsdp")
    def fsdp_cell(self, line: str, cell: str) -> None:
        """Run the cell on the ranks; any failing rank fails the cell.

        Shows rank 0's output plus every rank's errors by default (identical texts once);
        ``--group-outputs rank|type|order`` shows every rank.  Rich output from the ranks
        (figures, HTML) is shown too.  On ``--timeout`` the error carries every rank's
        stack, its last collectives and where the ranks disagree (``--native`` adds C/C++
        frames); ``-o NAME`` keeps the timeout error so that ``NAME.wait()`` can keep
        waiting.  Tracebacks and stacks name the cell as the notebook numbers it; a rank's
        failure stays available to ``%fsdp debug``.  ``fsdp_interactive.breakpoint(rank=R)``
        in the cell stops rank R and asks for debugger commands in the input box.  When
        ranks have waited ``--hang-notice`` seconds (the pool's 30 by default) in a
        collective other ranks never reach, a live notice names them, the collective and
        the line, until they move on; ``--no-hang-notice`` leaves it out.
        """
        args = self._parse_cell(line)
        if args.replay and args.no_replay:
            raise UsageError("%%fsdp: type either --replay or --no-replay, not both")
        hang_notice = cell_hang_notice(args.hang_notice, args.no_hang_notice, "%%fsdp")
        if self.pool is not None and self.pool.state == "broken":
            try:  # raises what happened to the group, and what works now
                self.pool.run(cell, cell=current_cell_number(self.shell))
            except pool_failures() as error:
                raise shown_as_message(error) from None
        pool = self.session.require_pool()
        targets = parse_targets(args.targets, pool.world_size)
        ranks = targets if targets is not None else list(range(pool.world_size))
        if targets is not None and len(ranks) < pool.world_size and not self._warned_subset:
            self._warned_subset = True
            print(
                f"[note: running on {', '.join(map(str, ranks))} only; a collective in this "
                "cell would wait for the other ranks forever]",
                file=sys.stderr,
            )
        stream = args.stream if args.stream is not None else stream_default()
        sink = StreamSink(ranks, all_ranks=args.group_outputs is not None, live=stream)
        try:
            result = pool.run(
                cell,
                targets=targets,
                timeout=args.timeout,
                on_output=sink,
                cell=current_cell_number(self.shell),
                native=args.native,
                replay=True if args.replay else False if args.no_replay else None,
                hang_notice=hang_notice,
            )
        except TimeoutError as error:
            sink.flush()
            if args.out:
                self.shell.user_ns[args.out] = error
            raise shown_as_message(error, args.out) from None
        except pool_failures() as error:
            sink.flush(error)
            if isinstance(error, rank_error_class()):
                self._last_failed_rank = min(error.ranks)
            show_outputs(outputs_of(sink, None, ranks), args.group_outputs, streamed=stream)
            raise shown_as_message(error) from None
        sink.flush()
        show_outputs(outputs_of(sink, result, ranks), args.group_outputs, streamed=stream)
        if args.out:
            self.shell.user_ns[args.out] = result
        if not is_attached(pool):  # a job has no journal: its journal options are ignored
            mark_cell(pool, local=args.local, export=args.export)
        if args.local:
            self.shell.ex(self.shell.transform_cell(cell))

    def _parse_cell(self, line: str) -> Any:
        try:
            return parse_argstring(self.fsdp_cell, line)
        except UsageError as error:
            raise UsageError(f"%%fsdp: {error}\n{usage_line(self.fsdp_cell, '%%fsdp')}") from None

    # ------------------------------------------------------------------ %fsdp_auto

    @line_magic
    @magic_arguments("fsdp_auto")
    @argument("mode", type=str.lower, choices=("on", "off"), help="on or off")
    def fsdp_auto(self, line: str) -> None:
        """Run the following cells on the ranks, as if each began with %%fsdp.

        While on, a cell that starts with ``%`` (any magic) or whose first line is
        ``# local`` runs in the kernel instead.
        """
        try:
            word = parse_argstring(self.fsdp_auto, line).mode
        except UsageError:
            raise UsageError(
                f"type %fsdp_auto on or %fsdp_auto off\n{usage_line(self.fsdp_auto, '%fsdp_auto')}"
            ) from None
        if word == "on":
            self.session.require_pool()
        self._set_auto(word == "on")

    def _set_auto(self, on: bool) -> None:
        transformers = self.shell.input_transformers_cleanup
        if on and _auto_transform not in transformers:
            transformers.append(_auto_transform)
        if not on and _auto_transform in transformers:
            transformers.remove(_auto_transform)
        self.auto = on


FSDP_SUMMARY = """Manage the rank pool: %fsdp COMMAND [arguments], one of the commands below.
Run a cell on the ranks with %%fsdp; %fsdp_auto on runs every following cell there."""

FsdpMagics.fsdp.__doc__ = line_magic_help(FsdpMagics, _SUBCOMMANDS, FSDP_SUMMARY)


def _auto_transform(lines: list[str]) -> list[str]:
    """Prefix ``%%fsdp`` to a cell unless it starts with ``%`` or ``# local`` or is empty."""
    content = [line for line in lines if line.strip()]
    if not content:
        return lines
    first = content[0].strip()
    if first.startswith("%") or first.lower().startswith("# local"):
        return lines
    return ["%%fsdp\n", *lines]


def load_ipython_extension(ipython: Any) -> None:
    """Register the magics on ``ipython`` (``%load_ext fsdp_interactive``)."""
    global _magics
    _magics = FsdpMagics(ipython)
    ipython.register_magics(_magics)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the pool the magics started and remove auto mode."""
    global _magics
    if _magics is not None:
        _magics._set_auto(False)
        if _magics.pool is not None:
            _magics.pool.stop()
        _magics = None
