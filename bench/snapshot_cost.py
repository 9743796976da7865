"""What a snapshot costs on CPU ranks, next to a disk checkpoint (a script, not a figure).

GPT-2 small built from its config (``GPT2Config()``: 124M parameters), wrapped per
``GPT2Block`` with ``fsdp_interactive.fsdp.FullyShardedDataParallel``, AdamW after one
step. Timed on rank 0, barrier to barrier, the contenders alternated sample by sample:

* ``snapshot()`` synchronous, into a snapshot folder under ``/dev/shm``;
* ``snapshot(background=True)``: the blocking part (until the call returns on every
  rank); the background write is then awaited, untimed;
* ``fsdp_interactive.checkpoint.save`` to a fresh folder under ``/tmp`` (disk), fsynced;
* ``restore_snapshot`` of the newest snapshot into the live objects.

It prints the medians, the ratio the recovery work aims at (blocking part of a background
snapshot <= 0.2x a synchronous disk save) and the bytes one snapshot holds per host.

    .venv/bin/python -m bench.snapshot_cost [--ranks 2] [--samples 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from bench.ranks import run_on_ranks


def _build() -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(GPT2LMHeadModel(GPT2Config()), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def _rank(shm_root: str, disk_root: str, samples: int) -> dict[str, Any]:
    import torch.distributed as dist

    import fsdp_interactive
    from fsdp_interactive import checkpoint as ck

    os.environ["FSDPI_SNAPSHOT_ROOT"] = shm_root
    model, optim = _build()
    parameters = sum(p.numel() for p in model.parameters())  # DTensors: global sizes
    counter = iter(range(1_000_000))

    def timed(action) -> float:
        dist.barrier()
        start = time.perf_counter()
        action()
        dist.barrier()
        return time.perf_counter() - start

    handles: list[Any] = []
    objects = {"model": model, "optimizer": optim}
    contenders = {
        "snapshot (sync)": lambda: fsdp_interactive.snapshot(model=model, optimizer=optim),
        "snapshot (background, blocking part)": lambda: handles.append(
            fsdp_interactive.snapshot(model=model, optimizer=optim, background=True)
        ),
        "checkpoint.save to disk": lambda: ck.save(
            f"{disk_root}/sample-{next(counter)}", model, optim, keep_last=1
        ),
        "restore_snapshot": lambda: ck.restore_snapshot(None, {}, objects=objects),
    }
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    blocking: list[float] = []
    for sample in range(samples + 1):  # the first round warms up, untimed
        for name, action in contenders.items():
            elapsed = timed(action)
            while handles:
                handle = handles.pop()
                handle.wait()
                if sample:
                    blocking.append(handle.seconds)
            if sample:
                seconds[name].append(elapsed)
    record = ck.list_snapshots()[-1]
    return {
        "seconds": seconds,
        "handle_seconds": blocking,
        "bytes_per_host": record.bytes_per_host,
        "parameters": parameters,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.snapshot_cost")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args(argv)
    shm = tempfile.mkdtemp(prefix="fsdpi-bench-snapshots-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="fsdpi-bench-checkpoints-", dir="/tmp")
    try:
        result = run_on_ranks(args.ranks, _rank, shm, disk, args.samples, timeout=3600)[0]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in result["seconds"].items()}
    print(
        f"GPT-2 small ({result['parameters'] / 1e6:.1f}M parameters) + AdamW, {args.ranks} CPU ranks"
    )
    for name, values in result["seconds"].items():
        shown = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {name:<40} median {medians[name]:.3f} s   ({shown})")
    print(f"  handle.seconds of the background snapshots: {result['handle_seconds']}")
    ratio = medians["snapshot (background, blocking part)"] / medians["checkpoint.save to disk"]
    print(f"  background blocking part / synchronous disk save: {ratio:.3f} (target <= 0.2)")
    for host, size in result["bytes_per_host"].items():
        print(f"  one snapshot holds {size / 2**20:.1f} MiB on host {host}")


if __name__ == "__main__":
    main()
