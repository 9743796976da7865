"""Figure 2, cold start: from nothing to a usable process group of ``N`` ranks.

* ``Pool(N).start()`` (ours): engines started, ``torch.distributed`` group formed; timed
  until ``start()`` returns.  The pool is stopped (untimed) before the next sample.
* torchrun (the reference): ``python -m torch.distributed.run --standalone`` of the
  trivial script ``bench/scripts/noop_rank.py``; timed from launch until rank 0 reports,
  after a barrier, that the group is up.

The two alternate, sample by sample, with two more rows that are not compared with a
target: the same ``Pool.start()`` with ipyparallel's own local launcher (every engine
started from scratch once the controller is up, importing torch on its first call; what
the pool did before it forked its engines), and ``Pool.restart()`` of the started pool
(the engine forker is kept, so no torch import happens).  Target: ours <= 1.0x
torchrun.
"""

from __future__ import annotations

import time

from bench.availability import missing
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, figure_main
from bench.torchrun import relaunch

POOL = "Pool(N).start() (ours)"
TORCHRUN = "torchrun to a ready group"
FROM_SCRATCH = "Pool(N).start() with engines started from scratch (ipyparallel's launcher)"
RESTART = "Pool.restart() of a started pool (ours)"
# Asking for ipyparallel's own way of passing the connection info turns the pool's
# forked, early-started engines off (see fsdp_interactive.pool._processes).
FROM_SCRATCH_ARGS = {"send_engines_connection_env": True}


def pool_start_seconds(world: int, restart: bool = False, **cluster_kwargs: object):
    """Seconds ``Pool(world).start()`` takes (and ``restart()`` after it, if asked).

    Returns ``(start_s, restart_s or None)``; the pool is stopped afterwards.
    """
    from fsdp_interactive.pool import Pool

    pool = Pool(world, devices="cpu", show_topology=False, **cluster_kwargs)
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
        restart_samples: list[float] = []
        scratch_samples: list[float] = []
        torchrun_samples: list[float] = []
        for _ in range(reps):
            if not unavailable:
                started, restarted = pool_start_seconds(world, restart=True)
                pool_samples.append(started)
                restart_samples.append(restarted)
                if not settings.quick:
                    scratch_samples.append(pool_start_seconds(world, **FROM_SCRATCH_ARGS)[0])
            torchrun_samples.append(relaunch(world).ready_s)
        subject = Stat(pool_samples, "s") if pool_samples else None
        reference = Stat(torchrun_samples, "s")
        result.measurements[f"{case}: {TORCHRUN}"] = reference
        if subject is not None:
            result.measurements[f"{case}: {POOL}"] = subject
            restarts = Stat(restart_samples, "s")
            result.measurements[f"{case}: {RESTART}"] = restarts
            result.notes.append(
                f"{case}: Pool.restart() took {restarts.median:.2f} s "
                f"({restarts.median / reference.median:.2f}x torchrun's start)."
            )
        if scratch_samples and subject is not None:
            scratch = Stat(scratch_samples, "s")
            result.measurements[f"{case}: {FROM_SCRATCH}"] = scratch
            result.notes.append(
                f"{case}: with engines started from scratch, Pool.start() took "
                f"{scratch.median:.2f} s ({scratch.median / reference.median:.2f}x torchrun) "
                f"instead of {subject.median:.2f} s."
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
