"""The live hang notice's cost: a cell's dispatch, and a long cell's collectives, with the
watch and without.

On one pool of 2 CPU ranks (:class:`fsdp_interactive.pool.Pool`):

* a normal cell: ``Pool.run("pass")`` with the notice on (the default threshold, 30 s)
  against ``hang_notice=False``, alternated round trip by round trip. A cell younger than
  the threshold is never looked at: the watch costs one clock reading per poll of the
  waiting loop. Target: <= 1.05x.
* a long cell: tiny ``all_reduce`` calls for a fixed time, counted on rank 0, with the
  watch looking at the ranks once a second all along (``hang_notice=1``: a look once a
  threshold, each asking every rank's agent for its stack and newest flight-recorder
  entries; at the default threshold, 30 s, a look comes once every 30 s) against the watch
  off, alternated. Target: >= 0.98x the collectives per second.
* one look's round trip from the kernel (both ranks asked at once, while they run that
  loop), no target.
"""

from __future__ import annotations

import time
from typing import Any

from bench.availability import missing
from bench.runner import (
    Comparison,
    FigureResult,
    Settings,
    Stat,
    Target,
    figure_main,
    measure_interleaved,
    rotated,
)

WATCHED = "Pool.run('pass'), notice on (threshold 30 s)"
UNWATCHED = "Pool.run('pass'), notice off"
LOOKED_AT = "all_reduce loop, looked at once a second (hang_notice=1)"
NOT_LOOKED_AT = "all_reduce loop, watch off"
LOOK = "one look at 2 ranks (kernel round trip)"
LOOP = (
    "import time as _time\n"
    "_end = _time.monotonic() + {seconds}\n"
    "_flag = torch.zeros(1)\n"
    "collectives = 0\n"
    "while True:\n"
    "    _flag.fill_(float(_time.monotonic() > _end))\n"
    "    dist.all_reduce(_flag)\n"
    "    collectives += 1\n"
    "    if _flag.item():\n"
    "        break\n"
)


def _loop_rate(pool: Any, seconds: float, hang_notice: float | bool) -> float:
    """Collectives per second rank 0 did in a cell of ``seconds`` with ``hang_notice``."""
    began = time.perf_counter()
    pool.run(LOOP.format(seconds=seconds), hang_notice=hang_notice, stream=False, journal=False)
    elapsed = time.perf_counter() - began
    return pool.pull("collectives", targets=[0])[0] / elapsed


def _look_seconds(pool: Any, looks: int) -> Stat:
    """Round trips of the watch's request to both ranks' agents while a loop runs there."""
    from fsdp_interactive.pool.diagnostics._hang_watch import _ASK_TIMEOUT_S, _TRACE_ENTRIES

    agents = pool._live.diagnosis.agents
    request = {"op": "stacks", "native": False, "trace": _TRACE_ENTRIES}
    samples = []
    for _ in range(looks):
        began = time.perf_counter()
        replies = agents.ask([0, 1], request, _ASK_TIMEOUT_S)
        samples.append(time.perf_counter() - began)
        if len(replies) != 2:
            raise RuntimeError(f"only ranks {sorted(replies)} answered a look")
    return Stat(samples, "s")


def run(settings: Settings) -> FigureResult:
    """The hang watch's cost on a normal cell's dispatch and on a long cell's collectives."""
    result = FigureResult("hang_watch", "Hang notice (its cost on cells)")
    unavailable = missing("fsdp_interactive.pool.diagnostics._hang_watch", "HangWatch")
    if unavailable:
        result.error = unavailable
        return result
    from fsdp_interactive.pool import Pool

    round_trips = 30 if settings.quick else 300
    loops = 2 if settings.quick else 8
    loop_s = 2.0 if settings.quick else 6.0
    result.notes.append(
        f"One pool of 2 CPU ranks. Normal cells: {round_trips} round trips per contender, "
        f"alternated, after {settings.warmup * 5} warm-up calls. Long cells: {loops} cells of "
        f"{loop_s:g} s per contender, alternated (the order rotating), each counting rank 0's "
        "all_reduce calls of one float."
    )
    pool = Pool(2, devices="cpu", show_topology=False)
    try:
        pool.start()
        dispatch = measure_interleaved(
            {
                WATCHED: lambda: pool.run("pass", hang_notice=30.0, journal=False),
                UNWATCHED: lambda: pool.run("pass", hang_notice=False, journal=False),
            },
            reps=round_trips,
            warmup=settings.warmup * 5,
        )
        rates: dict[str, list[float]] = {LOOKED_AT: [], NOT_LOOKED_AT: []}
        notice = {LOOKED_AT: 1.0, NOT_LOOKED_AT: False}
        for index in range(loops):
            for name in rotated(list(rates), index):
                rates[name].append(_loop_rate(pool, loop_s, notice[name]))
        looks = _look_seconds_during_loop(pool, 10 if settings.quick else 50)
    finally:
        pool.stop()
    loop_stats = {name: Stat(samples, "collectives/s") for name, samples in rates.items()}
    result.measurements.update(dispatch)
    result.measurements.update(loop_stats)
    result.measurements[LOOK] = looks
    stats = {**dispatch, **loop_stats}
    for case, subject, reference, target in (
        ("a normal cell (2 ranks)", WATCHED, UNWATCHED, Target("<=", 1.05)),
        ("a long cell of collectives (2 ranks)", LOOKED_AT, NOT_LOOKED_AT, Target(">=", 0.98)),
    ):
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=case,
                subject_name=subject,
                reference_name=reference,
                subject=stats[subject],
                reference=stats[reference],
                target=target,
                paired=True,
            )
        )
    return result


def _look_seconds_during_loop(pool: Any, looks: int) -> Stat:
    """:func:`_look_seconds` while the ranks run the all_reduce loop (sent without waiting)."""
    import threading

    done = threading.Event()
    failure: list[BaseException] = []

    def loop() -> None:
        try:
            pool.run(LOOP.format(seconds=3), hang_notice=False, stream=False, journal=False)
        except BaseException as error:  # reported below
            failure.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(1.0)  # the loop is running on both ranks
    try:
        return _look_seconds(pool, looks)
    finally:
        done.wait(60)
        if failure:
            raise failure[0]


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
