"""Figure 2, cold start: from nothing to a usable process group of ``N`` ranks, 1 to 8.

* ``Pool(N).start()`` (ours): engines started, ``torch.distributed`` group formed; timed
  until ``start()`` returns.  The pool is stopped (untimed) before the next sample.
* torchrun (the reference): ``python -m torch.distributed.run --standalone`` of the
  trivial script ``bench/scripts/noop_rank.py``; timed from launch until rank 0 reports,
  after a barrier, that the group is up.
* torchrun of ``bench/scripts/fsdp_ready_rank.py``: the same script after importing
  torch's FSDP, as an FSDP training script does first (a pool's ranks have it imported
  when ``start()`` returns): the like-for-like relaunch, shown without a target.

The three alternate, sample by sample, with two more rows that are not compared with a
target: the same ``Pool.start()`` with ipyparallel's own local launcher (every engine
started from scratch once the controller is up, importing torch on its first call; what
the pool did before it forked its engines; one sample per world size), and
``Pool.restart()`` of the started pool (the engine forker is kept, so no torch import
happens).  Target: ours <= 1.0x torchrun at every world size.
"""

from __future__ import annotations

import time

from bench.availability import missing
from bench.runner import Comparison, Curve, FigureResult, Settings, Stat, Target, figure_main
from bench.torchrun import FSDP_READY_SCRIPT, relaunch

POOL = "Pool(N).start() (ours)"
TORCHRUN = "torchrun to a ready group"
TORCHRUN_FSDP = "torchrun to a ready group, script importing torch's FSDP"
FROM_SCRATCH = "Pool(N).start() with engines started from scratch (ipyparallel's launcher)"
RESTART = "Pool.restart() of a started pool (ours)"
# Asking for ipyparallel's own way of passing the connection info turns the pool's
# forked, early-started engines off (see fsdp_interactive.pool.processes._launched).
FROM_SCRATCH_ARGS = {"send_engines_connection_env": True}


def pool_start_seconds(
    world: int, restart: bool = False, devices: str | None = "cpu", **cluster_kwargs: object
):
    """Seconds ``Pool(world).start()`` takes (and ``restart()`` after it, if asked).

    Returns ``(start_s, restart_s or None)``; the pool is stopped afterwards.
    """
    from fsdp_interactive.pool import Pool

    pool = Pool(world, devices=devices, show_topology=False, **cluster_kwargs)
    try:
        begin = time.perf_counter()
        pool.start()
        started = time.perf_counter() - begin
        restarted = None
        if restart:
            begin = time.perf_counter()
            pool.restart()
            restarted = time.perf_counter() - begin
        return started, restarted
    finally:
        pool.stop()


def run(settings: Settings) -> FigureResult:
    """Cold start: Pool.start() to a ready process group vs torchrun, at 1 to 8 ranks."""
    result = FigureResult("cold_start", "Cold start (launch to a ready process group)")
    unavailable = missing("fsdp_interactive.pool", "Pool")
    reps = 1 if settings.quick else 5
    result.notes.append(
        f"{reps} sample(s) per contender and world size, alternated; no warm-up beyond the "
        "OS cache. Engines started from scratch: one sample per world size (full mode only). "
        "Above 2 ranks the ranks outnumber this machine's cores."
    )
    series: dict[str, dict[int, Stat]] = {
        POOL: {},
        RESTART: {},
        FROM_SCRATCH: {},
        TORCHRUN: {},
        TORCHRUN_FSDP: {},
    }
    for world in settings.scaling_worlds:
        case = f"{world} rank{'s' if world > 1 else ''}"
        samples: dict[str, list[float]] = {name: [] for name in series}
        for _ in range(reps):
            if not unavailable:
                started, restarted = pool_start_seconds(world, restart=True)
                samples[POOL].append(started)
                samples[RESTART].append(restarted)
            samples[TORCHRUN].append(relaunch(world).ready_s)
            samples[TORCHRUN_FSDP].append(relaunch(world, FSDP_READY_SCRIPT).ready_s)
        if not unavailable and not settings.quick:
            samples[FROM_SCRATCH].append(pool_start_seconds(world, **FROM_SCRATCH_ARGS)[0])
        for name, values in samples.items():
            if values:
                series[name][world] = Stat(values, "s")
                result.measurements[f"{case}: {name}"] = series[name][world]
        for name, reference_name, target, note in (
            (POOL, TORCHRUN, Target("<=", 1.0), ""),
            (
                POOL,
                TORCHRUN_FSDP,
                None,
                "no target: against the relaunch of a script that imports FSDP",
            ),
            (RESTART, TORCHRUN, None, "no target: what a restart costs next to a relaunch"),
        ):
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case=case,
                    subject_name=name,
                    reference_name=reference_name,
                    subject=series[name].get(world),
                    reference=series[reference_name].get(world),
                    target=target,
                    unavailable=unavailable,
                    note=note,
                    paired=True,
                )
            )
    for name, stats in series.items():
        if not stats:
            continue
        worlds = sorted(stats)
        curve_reference = TORCHRUN if name in (POOL, RESTART) else None
        result.curves.append(
            Curve(
                figure=result.key,
                panel="Start to a ready process group",
                name=name,
                x_label="ranks",
                xs=[float(w) for w in worlds],
                values=[stats[w] for w in worlds],
                reference=curve_reference,
                target=Target("<=", 1.0) if name == POOL else None,
                ours=name not in (TORCHRUN, TORCHRUN_FSDP),
                paired=curve_reference is not None,
            )
        )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
