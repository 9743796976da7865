"""Figure 3, death detection: how long until a rank's death reaches the user, 1 to 8 ranks.

Every rank runs a long cell (``time.sleep(600)``); once all are in it, the last rank's
process is killed with SIGKILL and the time until the user learns of it is measured
from the kill:

* ours: the blocking ``Pool.run`` raises ``RankDied`` (the pool has found the dead rank,
  read its exit status and log tail, ended the other ranks and torn the group down);
  ``Pool.restart()``, untimed, gives the next sample a fresh group;
* raw ipyparallel: the pending ``AsyncResult`` of ``DirectView.execute`` raises
  (``EngineError``, once the engine's nanny has told the controller); each sample uses a
  fresh cluster;
* torchrun: the launcher exits with an error (its agent polls the workers every 0.1 s,
  then stops the others; ``bench/scripts/wait_rank.py``).

The three take turns, sample by sample.  No target: the figure shows what the user
waits for next to the two tools the pool replaces.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.availability import missing
from bench.dispatch import raw_cluster
from bench.runner import Comparison, Curve, FigureResult, Settings, Stat, figure_main, rotated
from bench.torchrun import death_latency

OURS = "Pool.run raises RankDied (ours)"
RAW = "raw ipyparallel AsyncResult raises EngineError"
TORCHRUN = "torchrun launcher exits"
LONG_CELL = "import time; time.sleep(600)"
# Give every rank time to enter the cell before the kill.
_SETTLE_S = 0.5
# How long to wait for raw ipyparallel to report the death before counting it as unreported.
RAW_LIMIT_S = 45.0
# The same in quick mode (a smoke run of the figure, where raw ipyparallel, which reports no
# death here, would spend this wait on every sample).
RAW_LIMIT_QUICK_S = 5.0


def _kill_later(pid: int, delay: float) -> tuple[threading.Thread, list[float]]:
    """Kill ``pid`` after ``delay`` seconds from a thread; the list gets the kill's time."""
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(delay)
        killed_at.append(time.perf_counter())
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, name="bench-kill", daemon=True)
    thread.start()
    return thread, killed_at


def ours_latency(pool: Any) -> float:
    """Kill the pool's last rank during a long cell; seconds until ``RankDied``."""
    from fsdp_interactive.pool import RankDied

    if not pool.running:
        pool.restart()
    thread, killed_at = _kill_later(pool.topology[-1].pid, _SETTLE_S)
    try:
        pool.run(LONG_CELL, stream=False, timeout=120)
    except RankDied:
        raised = time.perf_counter()
    else:
        raise RuntimeError("Pool.run returned although one of its ranks was killed")
    finally:
        thread.join()
    return raised - killed_at[0]


def raw_latency(world: int, limit: float = RAW_LIMIT_S) -> float:
    """The same on a fresh raw ipyparallel cluster: seconds until the result raises.

    Where the result has not raised ``limit`` seconds after the kill, ``limit`` itself is
    returned (a lower bound: the user is still waiting); the caller marks such samples.
    """
    import ipyparallel as ipp

    with raw_cluster(world) as view:
        pids = view.apply_sync(os.getpid)
        pending = view.execute(LONG_CELL, block=False)
        thread, killed_at = _kill_later(pids[-1], _SETTLE_S)
        try:
            pending.get(timeout=limit + _SETTLE_S)
        except (ipp.error.EngineError, ipp.error.CompositeError):
            raised = time.perf_counter()
        except ipp.error.TimeoutError:
            return limit
        else:
            raise RuntimeError("the raw cluster's call returned although an engine was killed")
        finally:
            thread.join()
    return raised - killed_at[0]


def run(settings: Settings) -> FigureResult:
    """Death detection: seconds from a rank's SIGKILL until the user is told."""
    result = FigureResult("death", "Death detection (SIGKILL of a rank to the error)")
    unavailable = missing("fsdp_interactive.pool", "Pool", "RankDied")
    reps = 1 if settings.quick else 2
    raw_limit = RAW_LIMIT_QUICK_S if settings.quick else RAW_LIMIT_S
    result.notes.append(
        f"{reps} sample(s) per contender and world size, alternated; the last rank is "
        f"killed {_SETTLE_S:g} s after the cell was sent. Above 2 ranks the ranks outnumber "
        "this machine's cores."
    )
    series: dict[str, dict[int, Stat]] = {OURS: {}, RAW: {}, TORCHRUN: {}}
    for world in settings.scaling_worlds:
        case = f"{world} rank{'s' if world > 1 else ''}"
        samples: dict[str, list[float]] = {name: [] for name in series}
        pool = None
        if not unavailable:
            from fsdp_interactive.pool import Pool

            pool = Pool(world, devices="cpu", show_topology=False).start()
        try:
            contenders: dict[str, Callable[[], float]] = {
                RAW: lambda world=world: raw_latency(world, raw_limit),
                TORCHRUN: lambda world=world: death_latency(world),
            }
            if pool is not None:
                contenders[OURS] = lambda pool=pool: ours_latency(pool)
            for index in range(reps):
                for name in rotated(list(contenders), index):
                    samples[name].append(contenders[name]())
        finally:
            if pool is not None:
                pool.stop()
        unreported = sum(1 for v in samples[RAW] if v >= raw_limit)
        if unreported:
            result.notes.append(
                f"{case}: raw ipyparallel had not reported the death {raw_limit:g} s after "
                f"the kill in {unreported} of {len(samples[RAW])} sample(s); those count as "
                f"{raw_limit:g} s (a lower bound)."
            )
        for name, values in samples.items():
            if values:
                series[name][world] = Stat(values, "s")
                result.measurements[f"{case}: {name}"] = series[name][world]
        for reference in (RAW, TORCHRUN):
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case=case,
                    subject_name=OURS,
                    reference_name=reference,
                    subject=series[OURS].get(world),
                    reference=series[reference][world],
                    target=None,
                    unavailable=unavailable,
                    note="no target: what the user waits for next to the tool replaced",
                    paired=True,
                )
            )
    for name, stats in series.items():
        if stats:
            worlds = sorted(stats)
            result.curves.append(
                Curve(
                    figure=result.key,
                    panel="SIGKILL of the last rank to the error",
                    name=name,
                    x_label="ranks",
                    xs=[float(w) for w in worlds],
                    values=[stats[w] for w in worlds],
                    reference=RAW if name == OURS else None,
                    ours=name == OURS,
                    paired=name == OURS,
                )
            )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
