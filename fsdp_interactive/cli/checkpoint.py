"""``fsdp-interactive checkpoint``: list checkpoints and convert them to/from plain files.

* ``checkpoint list DIR``: the published checkpoints in DIR (step, world size, time, size).
* ``checkpoint to-full CKPT OUT``: the model part of checkpoint folder CKPT as one plain
  state-dict file OUT (``.safetensors``, or a ``torch.save`` file that loads with
  ``torch.load(OUT, weights_only=True)``; ``--format`` overrides the suffix rule).
* ``checkpoint from-full SRC CKPT``: a plain state-dict file SRC as a checkpoint folder
  CKPT that ``fsdp_interactive.checkpoint.load`` reshards onto any number of ranks.

Runs in this one process, without a process group. Errors (a damaged checkpoint, a path
that is a file, no permission) print one line to stderr and exit with status 1.
Optimizer state is not converted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fsdp_interactive._text import text_table


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "checkpoint",
        help="list checkpoints; convert a checkpoint to/from a plain state-dict file",
        description=__doc__.split("\n\n")[0],
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="list the published checkpoints in a folder")
    listing.add_argument("dir", metavar="DIR", help="folder holding checkpoint folders")
    to_full = actions.add_parser(
        "to-full", help="write a checkpoint's model state as one plain state-dict file"
    )
    to_full.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder")
    to_full.add_argument("out", metavar="OUT", help="output file (.safetensors or torch.save)")
    to_full.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default=None,
        help="file format (default: safetensors for a .safetensors suffix, else torch)",
    )
    from_full = actions.add_parser(
        "from-full", help="write a plain state-dict file as a checkpoint folder"
    )
    from_full.add_argument("source", metavar="SRC", help="state-dict file (.safetensors or .pt)")
    from_full.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder to create")
    from_full.add_argument("--step", type=int, default=None, help="step to record (optional)")
    from_full.add_argument(
        "--overwrite", action="store_true", help="replace an existing checkpoint at CKPT"
    )
    return parser


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    from fsdp_interactive import checkpoint as ck

    try:
        if args.action == "list":
            records = ck.list_checkpoints(args.dir)
            if not records:
                print(f"no checkpoints in {args.dir}")
                return 0
            rows = [
                [
                    r.name,
                    "-" if r.step is None else r.step,
                    r.world_size,
                    r.created_utc,
                    _size(r.size_bytes),
                    "yes" if r.has_optimizer else "no",
                ]
                for r in records
            ]
            headers = ["name", "step", "world size", "created (UTC)", "size", "optimizer"]
            print(text_table(headers, rows))
            return 0
        if args.action == "to-full":
            result = ck.to_full(args.checkpoint, args.out, format=args.format)
            print(
                f"wrote {result.num_tensors} tensors ({_size(result.size_bytes)}, "
                f"{result.format}) to {result.output}"
            )
            return 0
        result = ck.from_full(
            args.source, args.checkpoint, step=args.step, overwrite=args.overwrite
        )
        print(f"wrote checkpoint {result.output} ({result.num_tensors} tensors)")
        return 0
    except (ck.CheckpointError, ValueError, TypeError) as exc:
        print(f"fsdp-interactive checkpoint {args.action}: error: {exc}", file=sys.stderr)
        return 1
