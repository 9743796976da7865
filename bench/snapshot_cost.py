"""Figure: snapshot cost: what a snapshot costs on CPU ranks, next to a disk checkpoint,
and how fast one restores.

Snapshots in host memory of GPT-2 small against a disk checkpoint, and the training rate
they leave (a figure run on request: ``python -m bench --only snapshot_cost --merge``).

GPT-2 small built from its config (``GPT2Config()``: 124M parameters), wrapped per
``GPT2Block`` with ``fsdp_interactive.fsdp.FullyShardedDataParallel``, AdamW after one
step. Timed on rank 0, barrier to barrier, the contenders alternated sample by sample:

* ``snapshot()`` synchronous, into a snapshot folder under ``/dev/shm``;
* ``snapshot(background=True)``: the blocking part (until the call returns on every
  rank); the background part is then awaited, untimed;
* ``fsdp_interactive.checkpoint.save`` to a fresh folder under ``/tmp`` (disk), fsynced;
* ``restore_snapshot`` of the newest snapshot into the live objects, and the rate it
  reads at (one host's bytes over its seconds).

Beside the wall time, the CPU seconds rank 0's process spent on each snapshot (all its
threads, the background part included: what a snapshot takes from training on a machine
whose cores the ranks share). With ``--rate-steps N`` (0: skipped), the training rate
over ``N`` steps without snapshots, with a background snapshot and with a synchronous one
every ``--every`` steps, in rotated order: each ratio is what a snapshot every
``--every`` steps costs.

    .venv/bin/python -m bench.snapshot_cost [--ranks 2] [--samples 3] [--rate-steps 20]
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
from bench.run_info import now_and_load
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, rotated

TITLE = "Snapshot cost (GPT-2 small: host memory against disk)"
SYNC = "snapshot (sync)"
BLOCKING = "snapshot (background, blocking part)"
DISK = "checkpoint.save to disk"
RESTORE = "restore_snapshot"
RESTORE_RATE = "restore_snapshot, GB per second per host"
RATE_TARGET_GB_S = 2.0
#: Rows of the training-rate comparison: contender -> its name in the report.
RATE_NAMES = {
    "none": "steps/s without snapshots",
    "background": "steps/s, a background snapshot every {every} steps",
    "sync": "steps/s, a synchronous snapshot every {every} steps",
}


def _build() -> tuple[Any, Any, Any]:
    import torch
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    config = GPT2Config()
    model = FSDP(GPT2LMHeadModel(config), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(step: int) -> None:
        import torch.distributed as dist

        generator = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
        tokens = torch.randint(0, config.vocab_size, (1, 32), generator=generator)
        model(tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    train_step(0)
    return model, optim, train_step


#: The rate loops' contenders: no snapshot, a background one and a synchronous one every
#: ``--every`` steps.
RATE_CONTENDERS = ("none", "background", "sync")


def _rates(model: Any, optim: Any, train_step: Any, steps: int, every: int, samples: int) -> dict:
    """Seconds of ``steps`` training steps without snapshots, with a background snapshot and
    with a synchronous one every ``every`` steps (:data:`RATE_CONTENDERS`), in an order
    rotated sample by sample, ``samples`` times (rank 0's, barrier to barrier)."""
    import torch.distributed as dist

    import fsdp_interactive

    seconds: dict[str, list[float]] = {name: [] for name in RATE_CONTENDERS}
    first = 1
    for sample in range(samples):
        for name in rotated(list(RATE_CONTENDERS), sample):
            handle = None
            dist.barrier()
            began = time.perf_counter()
            for step in range(first, first + steps):
                train_step(step)
                if name != "none" and (step + 1) % every == every // 2:
                    handle = fsdp_interactive.snapshot(
                        model=model, optimizer=optim, step=step + 1, background=name == "background"
                    )
            if name == "background" and handle is not None:
                handle.wait()
            dist.barrier()
            seconds[name].append(time.perf_counter() - began)
            first += steps
    return seconds


def _freeze_imports() -> None:
    """Import what the ranks run, then freeze those objects out of the cyclic garbage
    collector, as a pool's engine forker does before it forks an engine: the collector's
    full passes then walk the training's objects only (about 0.2 s less per pass here)."""
    import gc

    import torch.distributed.checkpoint  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    import fsdp_interactive.checkpoint
    import fsdp_interactive.fsdp  # noqa: F401

    gc.freeze()


def _rank(shm_root: str, disk_root: str, samples: int, rate_steps: int, every: int) -> dict:
    import torch.distributed as dist

    import fsdp_interactive
    from fsdp_interactive import checkpoint as ck

    os.environ["FSDPI_SNAPSHOT_ROOT"] = shm_root
    _freeze_imports()
    model, optim, train_step = _build()
    parameters = sum(p.numel() for p in model.parameters())  # DTensors: global sizes
    counter = iter(range(1_000_000))

    def timed(action) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds) of ``action``, barrier to barrier."""
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        action()
        dist.barrier()
        return time.perf_counter() - start, time.process_time() - cpu

    handles: list[Any] = []
    reports: list[Any] = []
    objects = {"model": model, "optimizer": optim}
    contenders = {
        "snapshot (sync)": lambda: fsdp_interactive.snapshot(model=model, optimizer=optim),
        "snapshot (background, blocking part)": lambda: handles.append(
            fsdp_interactive.snapshot(model=model, optimizer=optim, background=True)
        ),
        "checkpoint.save to disk": lambda: ck.save(
            f"{disk_root}/sample-{next(counter)}", model, optim, keep_last=1
        ),
        "restore_snapshot": lambda: reports.append(ck.restore_snapshot(None, {}, objects=objects)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {
        "snapshot (sync)": [],
        "snapshot (background, whole)": [],
        "restore_snapshot": [],
    }
    handle_seconds: list[float] = []
    phases: list[dict[str, float]] = []
    for sample in range(samples + 1):  # the first round warms up, untimed
        for name, action in contenders.items():
            if name == "restore_snapshot":
                elapsed = timed(action)
                phases.append(reports.pop().phases)
                if sample:
                    cpu[name].append(elapsed[1])
            elif name.startswith("snapshot (background"):
                used = time.process_time()
                elapsed = timed(action)
                handle = handles.pop()
                handle.wait()
                if sample:
                    handle_seconds.append(handle.seconds)
                    cpu["snapshot (background, whole)"].append(time.process_time() - used)
            else:
                elapsed = timed(action)
                if sample and name == "snapshot (sync)":
                    cpu[name].append(elapsed[1])
            if sample:
                seconds[name].append(elapsed[0])
    record = ck.list_snapshots()[-1]
    rates = _rates(model, optim, train_step, rate_steps, every, samples) if rate_steps else {}
    return {
        "seconds": seconds,
        "cpu": cpu,
        "handle_seconds": handle_seconds,
        "restore_phases": phases[1:],
        "bytes_per_host": record.bytes_per_host,
        "parameters": parameters,
        "rates": rates,
    }


def figure(result: dict, ranks: int, rate_steps: int, every: int) -> FigureResult:
    """The figure of one measurement (what ``_rank`` returned on rank 0)."""
    case = f"{ranks} ranks"
    out = FigureResult("snapshot_cost", TITLE)
    out.notes.append(
        f"GPT-2 small ({result['parameters'] / 1e6:.1f}M parameters) + AdamW; contenders "
        "alternated sample by sample, timed on rank 0 barrier to barrier; the first round "
        "warms up, untimed."
    )
    seconds = {name: Stat(values, "s") for name, values in result["seconds"].items()}
    for name, stat in seconds.items():
        out.measurements[f"{case}: {name}"] = stat
    for name, values in result["cpu"].items():
        out.measurements[f"{case}: CPU seconds of rank 0, {name}"] = Stat(values, "CPU-s")
    host_bytes = max(result["bytes_per_host"].values())
    rate = Stat([host_bytes / t / 1e9 for t in result["seconds"][RESTORE]], "GB/s")
    out.measurements[f"{case}: {RESTORE_RATE}"] = rate
    rows = [
        (BLOCKING, DISK, seconds, Target("<=", 0.2), ""),
        (SYNC, DISK, seconds, None, "no target: a synchronous snapshot beside a disk save"),
        (
            RESTORE_RATE,
            f"{RATE_TARGET_GB_S:g} GB/s per host",
            {RESTORE_RATE: rate, f"{RATE_TARGET_GB_S:g} GB/s per host": Stat([2.0], "GB/s")},
            Target(">=", 1.0),
            "",
        ),
    ]
    if result["rates"]:
        steps = {
            RATE_NAMES[k].format(every=every): Stat([rate_steps / v for v in values], "steps/s")
            for k, values in result["rates"].items()
        }
        out.measurements.update({f"{case}: {name}": stat for name, stat in steps.items()})
        plain = RATE_NAMES["none"]
        for kind in ("background", "sync"):
            rows.append(
                (RATE_NAMES[kind].format(every=every), plain, steps, Target(">=", 0.97), "")
            )
    for subject, reference, stats, target, note in rows:
        out.comparisons.append(
            Comparison(
                figure=out.key,
                case=case,
                subject_name=subject,
                reference_name=reference,
                subject=stats[subject],
                reference=stats[reference],
                target=target,
                note=note,
                paired=len(stats[subject].samples) == len(stats[reference].samples) > 1,
            )
        )
    return out


def measure(ranks: int, samples: int, rate_steps: int, every: int) -> tuple[dict, FigureResult]:
    """Run the measurement on ``ranks`` fresh gloo ranks; its raw result and its figure."""
    shm = tempfile.mkdtemp(prefix="fsdpi-bench-snapshots-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="fsdpi-bench-checkpoints-", dir="/tmp")
    try:
        result = run_on_ranks(ranks, _rank, shm, disk, samples, rate_steps, every, timeout=7200)[0]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return result, figure(result, ranks, rate_steps, every)


def run(settings: Settings) -> FigureResult:
    """Snapshot cost at 2 ranks: 3 samples and 20-step rate loops (1 and 4 in quick mode)."""
    if settings.quick:
        return measure(2, 1, 4, 2)[1]
    return measure(2, settings.samples or 3, 20, 10)[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.snapshot_cost")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument(
        "--rate-steps", type=int, default=0, help="steps per rate measurement (0: skip it)"
    )
    parser.add_argument("--every", type=int, default=10, help="steps between snapshots")
    args = parser.parse_args(argv)
    print(f"started {now_and_load()}", flush=True)
    result = measure(args.ranks, args.samples, args.rate_steps, args.every)[0]
    medians = {name: statistics.median(values) for name, values in result["seconds"].items()}
    print(
        f"GPT-2 small ({result['parameters'] / 1e6:.1f}M parameters) + AdamW, {args.ranks} CPU ranks"
    )
    for name, values in result["seconds"].items():
        shown = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {name:<40} median {medians[name]:.3f} s   ({shown})")
    print(f"  handle.seconds of the background snapshots: {result['handle_seconds']}")
    for name, values in result["cpu"].items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"  CPU s of rank 0, {name:<31} median {statistics.median(values):.2f} ({shown})")
    ratio = medians["snapshot (background, blocking part)"] / medians["checkpoint.save to disk"]
    print(f"  background blocking part / synchronous disk save: {ratio:.3f} (target <= 0.2)")
    host_bytes = max(result["bytes_per_host"].values())
    for host, size in result["bytes_per_host"].items():
        print(f"  one snapshot holds {size / 2**20:.1f} MiB on host {host}")
    restore = medians["restore_snapshot"]
    print(f"  restore reads {host_bytes / restore / 1e9:.2f} GB/s per host (median)")
    for phases in result["restore_phases"]:
        print("  restore phases: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    rates = result["rates"]
    if rates:
        none = statistics.median(rates["none"])
        print(
            f"  {args.rate_steps} steps without snapshots: {none:.2f} s "
            f"({', '.join(f'{v:.2f}' for v in rates['none'])})"
        )
        for name in RATE_CONTENDERS[1:]:
            with_one = statistics.median(rates[name])
            print(
                f"  {args.rate_steps} steps with a {name} snapshot every {args.every}: "
                f"{with_one:.2f} s ({', '.join(f'{v:.2f}' for v in rates[name])}): "
                f"{none / with_one:.3f}x the rate (target >= 0.97)"
            )
    print(f"finished {now_and_load()}", flush=True)


if __name__ == "__main__":
    main()
