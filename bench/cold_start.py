"""Figure 2, cold start: from nothing to a usable process group of ``N`` ranks.

* ``Pool(N).start()`` (ours): engines started, ``torch.distributed`` group formed; timed
  until ``start()`` returns.  The pool is stopped (untimed) before the next sample.
* torchrun (the reference): ``python -m torch.distributed.run --standalone`` of the
  trivial script ``bench/scripts/noop_rank.py``; timed from launch until rank 0 reports,
  after a barrier, that the group is up.

The two alternate, sample by sample, with a third contender that is an experiment, not
the shipped default: the same ``Pool.start()`` with ipyparallel's controller heartbeat
period (``HeartMonitor.period``) at 300 ms instead of 3 s.  Target: ours <= 1.0x
torchrun.
"""

from __future__ import annotations

import time

from bench.availability import missing
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, figure_main
from bench.torchrun import relaunch

POOL = "Pool(N).start() (ours)"
TORCHRUN = "torchrun to a ready group"
FAST_HEARTBEAT = "Pool(N).start() with HeartMonitor.period=300 ms (experiment, not the default)"
# ipyparallel's Hub completes an engine's registration only once its heart monitor has
# seen the engine beat; the monitor pings every 3 s by default.
FAST_HEARTBEAT_ARGS = {"controller_args": ["--HeartMonitor.period=300"]}


def pool_start_seconds(world: int, **cluster_kwargs: object) -> float:
    """Seconds ``Pool(world).start()`` takes; the pool is stopped afterwards."""
    from fsdp_interactive.pool import Pool

    pool = Pool(world, devices="cpu", show_topology=False, **cluster_kwargs)
    try:
        start = time.perf_counter()
        pool.start()
        return time.perf_counter() - start
    finally:
        pool.stop()


def run(settings: Settings) -> FigureResult:
    """Cold start: Pool.start() to a ready process group vs torchrun."""
    result = FigureResult("cold_start", "Cold start (launch to a ready process group)")
    unavailable = missing("fsdp_interactive.pool", "Pool")
    reps = 1 if settings.quick else 3
    result.notes.append(
        f"{reps} sample(s) per contender, alternated; no warm-up beyond the OS cache."
    )
    for world in settings.world_sizes:
        case = f"{world} ranks"
        pool_samples: list[float] = []
        fast_samples: list[float] = []
        torchrun_samples: list[float] = []
        for _ in range(reps):
            if not unavailable:
                pool_samples.append(pool_start_seconds(world))
                if not settings.quick:
                    fast_samples.append(pool_start_seconds(world, **FAST_HEARTBEAT_ARGS))
            torchrun_samples.append(relaunch(world).ready_s)
        subject = Stat(pool_samples, "s") if pool_samples else None
        reference = Stat(torchrun_samples, "s")
        result.measurements[f"{case}: {TORCHRUN}"] = reference
        if subject is not None:
            result.measurements[f"{case}: {POOL}"] = subject
        if fast_samples:
            fast = Stat(fast_samples, "s")
            result.measurements[f"{case}: {FAST_HEARTBEAT}"] = fast
            result.notes.append(
                f"{case}: with the controller's heartbeat period at 300 ms instead of 3 s, "
                f"Pool.start() took {fast.median:.2f} s ({fast.median / reference.median:.2f}x "
                f"torchrun) instead of {subject.median:.2f} s."
            )
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=case,
                subject_name=POOL,
                reference_name=TORCHRUN,
                subject=subject,
                reference=reference,
                target=Target("<=", 1.0),
                unavailable=unavailable,
            )
        )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
