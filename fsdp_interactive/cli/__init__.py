"""The ``fsdp-interactive`` command line.

Each subcommand lives in its own module of this package and exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` and ``run(args) -> int``.
Bad options exit with status 2 and a usage line (argparse's behaviour).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

# Subcommand modules, in the order ``--help`` lists them.
SUBCOMMANDS: tuple[str, ...] = ("demo", "doctor", "lab", "checkpoint")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    # The installed distribution's version: the package root sits above the CLI's layer.
    version = importlib.metadata.version("fsdp-interactive")
    parser = argparse.ArgumentParser(
        prog="fsdp-interactive",
        description="Interactive distributed training with PyTorch FSDP.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"fsdp_interactive.cli.{name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fsdp-interactive`` console script."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
