"""``fsdp-interactive demo``: train a tiny transformer with FullyShardedDataParallel on a pool."""

from __future__ import annotations

import argparse

from fsdp_interactive.cli._arguments import positive_int


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="train a small transformer with FSDP on a rank pool and write a report",
        description=(
            "Start a pool (one rank per GPU if any, else 2 CPU ranks), train a tiny "
            "transformer with FullyShardedDataParallel (FULL_SHARD, one unit per block), "
            "print the shard layout and a gradient-norm summary, save a checkpoint and "
            "write a PNG report."
        ),
    )
    parser.add_argument("-n", "--ranks", type=positive_int, default=None, help="number of ranks")
    parser.add_argument("--steps", type=positive_int, default=40, help="optimizer steps (40)")
    parser.add_argument("--dim", type=positive_int, default=64, help="model width (64)")
    parser.add_argument("--layers", type=positive_int, default=4, help="transformer blocks (4)")
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on GPUs, else gloo"
    )
    parser.add_argument(
        "-o", "--out", default="out/demo", help="output folder for the checkpoint and report"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from fsdp_interactive.demo import DemoConfig, run_demo

    try:
        config = DemoConfig(steps=args.steps, dim=args.dim, layers=args.layers)
    except ValueError as exc:
        print(f"fsdp-interactive demo: error: {exc}")
        return 2
    run_demo(config, args.out, ranks=args.ranks, backend=args.backend)
    return 0
