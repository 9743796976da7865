"""What every ``%fsdp`` subcommand works with: the shell, the pool (or attached job) the
magics drive, the check that it runs, and reading a subcommand's arguments.

One :class:`MagicSession` per :class:`~.magics.FsdpMagics`. The magics' own subcommands
and each group of the others (:class:`Subcommands`: :mod:`._recovery_magics`,
:mod:`._script_magics`, :mod:`._attach_magics`) are given it; ``%fsdp COMMAND`` runs the
method ``_fsdp_COMMAND(rest)`` of whichever holds it (:func:`subcommand`), and the magic
reference is written from the same methods' parsers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from fsdp_interactive.notebook._magic_usage import usage_line


class MagicSession:
    """The shell and the pool of one set of magics.

    ``pool``: the :class:`~fsdp_interactive.pool.Pool` that ``%fsdp start`` started, the
    :class:`~fsdp_interactive.pool.AttachedJob` that ``%fsdp attach`` attached to, or
    ``None``.
    """

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.pool: Any = None

    def require_pool(self) -> Any:
        """The pool, running; ``UsageError`` saying what to type when there is none, a rank
        died, or it is stopped."""
        pool = self.pool
        if pool is None:
            raise UsageError("no running pool; start one with %fsdp start -n 2")
        if pool.state == "broken":
            death = pool.check().death
            what = f": {death.summary}" if death is not None else ""
            steps = "%fsdp recover or %fsdp restart" if pool.snapshots() else "%fsdp restart"
            raise UsageError(f"no running pool (a rank died{what}); type {steps}")
        if not pool.running:
            raise UsageError(
                f"no running pool (the pool is {pool.state}); start one with %fsdp restart"
            )
        return pool

    @staticmethod
    def parse(func: Any, rest: str, command: str) -> Any:
        """``rest`` read by the parser of ``func`` (a subcommand's method); a mistake raises
        ``UsageError`` with ``%fsdp COMMAND``'s usage line."""
        try:
            return parse_argstring(func, rest)
        except UsageError as error:
            raise UsageError(
                f"%fsdp {command}: {error}\n{usage_line(func, f'%fsdp {command}')}"
            ) from None

    @staticmethod
    def no_arguments(command: str, rest: str) -> None:
        """Refuse arguments to a subcommand that takes none."""
        if rest.strip():
            raise UsageError(f"%fsdp {command} takes no arguments; type just %fsdp {command}")


class Subcommands:
    """A group of ``%fsdp`` subcommands, each a method ``_fsdp_COMMAND(rest)`` declaring its
    options with IPython's ``magic_arguments``, working with the magics' ``session``."""

    def __init__(self, session: MagicSession) -> None:
        self.session = session


def subcommand(owner: Any, command: str) -> Callable[[str], Any] | None:
    """The method of ``owner`` (an instance or a class) that runs ``%fsdp command``."""
    return getattr(owner, f"_fsdp_{command}", None)
