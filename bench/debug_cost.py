"""Debugging aids' cost: training steps/s with torch's flight recorder off, at the pool's
default buffer, at torch's default buffer, and with strict collectives.

The same model and step as :mod:`bench.train_step` (ours, FULL_SHARD, fp32, AdamW).
What the pool sets on its ranks is set here the same way, in the ranks' environment
before the process group forms: ``TORCH_FR_BUFFER_SIZE`` (0: off; 64: the pool's
default; 2000: torch's own default when the variable is unset) and
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``Pool(check_collectives=True)``). Each setting needs
fresh processes, so a sample is a fresh group, its ranks pinned one per core: the
settings take turns, the order rotating from round to round, so that machine noise hits
them alike; within a group, one-step samples are timed after warm-up steps
(:func:`bench.step_timing.timed_steps`) and the group's sample is their median, by the
wall clock of rank 0 and by the process CPU time of all ranks.  Each ratio is the median
of the per-round ratios.  Each group also reports how many entries its recorder holds,
which shows the setting took effect.

A second measurement isolates what the recorder adds to each collective: the time of
one tiny ``all_reduce`` (many in a row) with the recorder off and on, and the number of
collectives one training step issues (counted by the recorder). Their product over the
step time is the recorder's share of a step, which stays measurable when the machine's
noise is larger than the effect on whole steps.

Targets: the recorder at the pool's default costs at most 1% (steps/s >= 0.99x off).
"""

from __future__ import annotations

import time
from typing import Any

from bench.models import batch_for, build_model, train_step, wrap_ours
from bench.ranks import run_on_ranks
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, figure_main, rotated
from bench.train_step import model_size

SETTINGS: dict[str, dict[str, str]] = {
    "recorder off": {"TORCH_FR_BUFFER_SIZE": "0"},
    "recorder, 64 entries (pool default)": {"TORCH_FR_BUFFER_SIZE": "64"},
    "recorder, 2000 entries (torch default)": {"TORCH_FR_BUFFER_SIZE": "2000"},
    "strict collectives (DETAIL), recorder 64": {
        "TORCH_FR_BUFFER_SIZE": "64",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    },
}
REFERENCE = "recorder off"
# measure's suffix of a case -> unit: rank 0's wall clock, all ranks' process CPU time
MEASURES = {"": "steps/s", ", CPU time": "steps/CPU-s"}


def _rank_steps(size: Any, reps: int, warmup: int) -> dict[str, Any]:
    """This rank's median step seconds (wall, process CPU) and the recorder's entry count."""
    import pickle
    import statistics

    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    from bench.step_timing import timed_steps

    model = wrap_ours(build_model(size), torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = batch_for(size, dist.get_rank())

    for _ in range(warmup):
        timed_steps(model, optim, batch, 1)
    times = [timed_steps(model, optim, batch, 1) for _ in range(reps)]
    entries = len(pickle.loads(c10d._dump_fr_trace(True, False, False)).get("entries", []))
    return {
        "wall": statistics.median(t.wall for t in times),
        "cpu": statistics.median(t.process_cpu for t in times),
        "entries": entries,
        "debug": str(dist.get_debug_level()),
    }


def _rank_collective_time(count: int, reps: int) -> dict[str, Any]:
    """Seconds per tiny all_reduce (median over ``reps`` runs of ``count``, rank 0's clock)."""
    import statistics

    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    for _ in range(count):  # warm-up
        dist.all_reduce(tensor)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(tensor)
        times.append((time.perf_counter() - start) / count)
    return {"seconds": statistics.median(times)}


def _rank_collectives_per_step(size: Any, steps: int) -> dict[str, Any]:
    """Collectives one training step issues, counted by the recorder (needs a buffer)."""
    import pickle

    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    model = wrap_ours(build_model(size), torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = batch_for(size, dist.get_rank())
    train_step(model, optim, batch)

    def issued() -> int:
        status = pickle.loads(c10d._dump_fr_trace(True, False, False)).get("pg_status", {})
        return sum(int(s.get("last_enqueued_collective", 0)) for s in status.values())

    before = issued()
    for _ in range(steps):
        train_step(model, optim, batch)
    return {"per_step": (issued() - before) / steps}


def run(settings: Settings) -> FigureResult:
    """Debugging aids' cost: steps/s with the flight recorder and strict collectives."""
    result = FigureResult("debug_cost", "Cost of the flight recorder and strict collectives")
    size = model_size(settings)
    steps = 1
    reps = 3 if settings.quick else 30
    warmup = settings.warmup * 5
    rounds = 2 if settings.quick else 12
    world = 2
    result.notes.append(
        f"{world} ranks, {size.blocks} blocks of width {size.dim}, batch {size.batch}; "
        f"{rounds} rounds, each a fresh group per setting ({warmup} warm-up steps, the "
        f"median of {reps} one-step samples)."
    )
    rates: dict[str, dict[str, list[float]]] = {
        measure: {n: [] for n in SETTINGS} for measure in MEASURES
    }
    seen: dict[str, set[tuple[int, str]]] = {name: set() for name in SETTINGS}
    for index in range(rounds):
        for name in rotated(list(SETTINGS), index):
            per_rank = run_on_ranks(
                world, _rank_steps, size, reps, warmup, env=SETTINGS[name], pin_cores=True
            )
            rates[""][name].append(steps / per_rank[0]["wall"])
            rates[", CPU time"][name].append(steps / sum(rank["cpu"] for rank in per_rank))
            seen[name].add((per_rank[0]["entries"], per_rank[0]["debug"]))
    for measure, unit in MEASURES.items():
        for name, values in rates[measure].items():
            result.measurements[f"{world} ranks{measure}: {name}"] = Stat(values, unit)
    for name, states in seen.items():
        described = ", ".join(
            f"{entries} recorder entries, debug level {d}" for entries, d in sorted(states)
        )
        result.notes.append(f"{name}: {described}.")
    # What the recorder adds to one collective, and how many one step issues.
    count = 200 if settings.quick else 1000
    per_collective: dict[str, list[float]] = {"recorder off": [], "recorder on (64)": []}
    envs = {"recorder off": "0", "recorder on (64)": "64"}
    for _ in range(rounds):
        for name, size_env in envs.items():
            out = run_on_ranks(
                world,
                _rank_collective_time,
                count,
                settings.reps,
                env={"TORCH_FR_BUFFER_SIZE": size_env},
                pin_cores=True,
            )[0]
            per_collective[name].append(out["seconds"] * 1e6)
    per_step = run_on_ranks(
        world, _rank_collectives_per_step, size, 5, env={"TORCH_FR_BUFFER_SIZE": "2000"}
    )[0]["per_step"]
    for name, values in per_collective.items():
        result.measurements[f"{world} ranks: tiny all_reduce, {name}"] = Stat(values, "us")
    on_us = Stat(per_collective["recorder on (64)"], "us")
    off_us = Stat(per_collective["recorder off"], "us")
    added_us = on_us.median - off_us.median
    step_us = 1e6 / Stat(rates[""][REFERENCE], "steps/s").median
    if on_us.min <= off_us.max and off_us.min <= on_us.max:
        share = (
            f"the samples overlap (off {off_us.min:.0f}..{off_us.max:.0f} us, on "
            f"{on_us.min:.0f}..{on_us.max:.0f} us): the difference ({added_us:+.1f} us) is "
            "below what this machine resolves"
        )
    else:
        share = (
            f"the recorder adds {added_us:.1f} us to each, "
            f"{100 * added_us * per_step / step_us:.2f}% of a step"
        )
    result.notes.append(
        f"A tiny all_reduce takes {off_us.median:.0f} us with the recorder off and "
        f"{on_us.median:.0f} us with it on (medians); {share}. A training step issues "
        f"{per_step:.0f} collectives and takes {step_us / 1e3:.1f} ms."
    )
    for measure, unit in MEASURES.items():
        off = Stat(rates[measure][REFERENCE], unit)
        for name in SETTINGS:
            if name == REFERENCE:
                continue
            pool_default = name.startswith("recorder, 64")
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case=f"{world} ranks{measure}",
                    subject_name=name,
                    reference_name=REFERENCE,
                    subject=Stat(rates[measure][name], unit),
                    reference=off,
                    target=Target(">=", 0.99) if pool_default else None,
                    note=""
                    if pool_default
                    else "shown for comparison; only the pool's default has a target",
                    paired=True,
                )
            )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
