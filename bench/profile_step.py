"""Where the training step's time goes, per phase and per operator (``python -m bench.profile_step``).

On 2 ranks, fp32, with torch's default AdamW (the per-parameter loop on CPU) and with
``foreach=True``, each contender of the training-step figure (ours, torch FSDP1,
``fully_shard`` by hand) runs ``steps`` steps; rank 0's main-thread CPU time
(``time.thread_time``, so time spent waiting to be scheduled is left out) is split into
forward, backward and optimizer step (medians over the steps), and ``torch.profiler``
lists the operators with the most self CPU time.  Prints a Markdown report; nothing is
written.  Options: ``--steps N`` (default 12), ``--top N`` operators (default 8).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.models import WRAPPERS, ModelSize, batch_for, build_model
from bench.ranks import run_on_ranks

SIZE = ModelSize(dim=256, blocks=4, batch=32)
LABELS = {
    "fsdp1": "torch FSDP1",
    "fully_shard": "fully_shard by hand",
    "ours": "FullyShardedDataParallel (ours)",
}


def _rank_profile(steps: int, top: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank()
    batch = batch_for(SIZE, rank)
    out: dict[str, Any] = {}
    for optim_name, kwargs in (("default AdamW", {}), ("AdamW(foreach=True)", {"foreach": True})):
        for name in LABELS:
            model = WRAPPERS[name](build_model(SIZE), torch.float32)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
            phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}

            def step(
                record: bool, model: Any = model, optim: Any = optim, phases: Any = phases
            ) -> None:
                optim.zero_grad(set_to_none=True)
                t0 = time.thread_time()
                loss = nn.functional.mse_loss(model(batch), batch)
                t1 = time.thread_time()
                loss.backward()
                t2 = time.thread_time()
                optim.step()
                t3 = time.thread_time()
                if record:
                    for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                        phases[key].append(value)

            for _ in range(2):
                step(False)
            dist.barrier()
            for _ in range(steps):
                step(True)
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    step(False)
            dist.barrier()
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            out[f"{optim_name}|{name}"] = {
                "phases": {k: statistics.median(v) for k, v in phases.items()},
                "ops": [
                    (e.key, e.self_cpu_time_total / 3 / 1e3, e.count // 3) for e in events[:top]
                ],
            }
            del model, optim
    return out


def report(per_rank0: dict[str, Any]) -> str:
    lines = [
        "| Optimizer | Contender | forward | backward | optimizer step | total (ms CPU/step) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, data in per_rank0.items():
        optim_name, name = key.split("|")
        p = data["phases"]
        total = sum(p.values())
        lines.append(
            f"| {optim_name} | {LABELS[name]} | {p['forward'] * 1e3:.1f} | "
            f"{p['backward'] * 1e3:.1f} | {p['optimizer'] * 1e3:.1f} | {total * 1e3:.1f} |"
        )
    for key, data in per_rank0.items():
        optim_name, name = key.split("|")
        lines += ["", f"Top operators by self CPU time, {LABELS[name]}, {optim_name} (per step):"]
        lines += [f"- `{op}`: {ms:.1f} ms, {count} calls" for op, ms, count in data["ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        parser.error("--steps and --top must be at least 1")
    print(report(run_on_ranks(2, _rank_profile, args.steps, args.top)[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
