"""Figure 1, cell dispatch: the round trip of a no-op cell on every rank.

Contenders, at each world size:

* raw ipyparallel: ``DirectView.execute("pass", block=True)`` on a plain ``ipyparallel``
  cluster of ``N`` engines (the reference);
* a ``%%fsdp`` cell whose body is ``pass``, run by a real IPython shell with the
  extension loaded, on a pool started with ``%fsdp start -n N --devices cpu`` (ours);
* ``Pool.run("pass")`` on that same pool (ours);
* relaunching the same trivial script with torchrun (``bench/scripts/noop_rank.py``:
  join the process group, run ``pass``, leave), timed launch to exit.

The in-process contenders are timed alternately, one round trip per sample, after
warm-up calls.  Targets: ours <= 1.2x raw ipyparallel; ours >= 500x faster than a
torchrun relaunch.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
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
)
from bench.torchrun import relaunch

RAW = "raw ipyparallel DirectView.execute"
POOL = "Pool.run (ours)"
MAGIC = "%%fsdp cell (ours)"
TORCHRUN = "torchrun relaunch"
NOOP = "pass"


@contextlib.contextmanager
def raw_cluster(n: int) -> Iterator[Any]:
    """A plain ipyparallel cluster of ``n`` engines; yields a DirectView on all of them."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=n, log_level=40)
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(n, timeout=120)
        yield client[:]
        client.close()
    finally:
        cluster.stop_cluster_sync()


@contextlib.contextmanager
def pool(n: int) -> Iterator[Any]:
    """A running ``Pool`` of ``n`` CPU ranks, stopped on exit."""
    from fsdp_interactive.pool import Pool

    handle = Pool(n, devices="cpu", show_topology=False)
    try:
        yield handle.start()
    finally:
        handle.stop()


def magic_unavailable() -> str | None:
    return missing("fsdp_interactive.notebook.magics", "load_ipython_extension", "current_pool")


def _quiet_cell(shell: Any, source: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        outcome = shell.run_cell(source, store_history=False)
    if not outcome.success:
        error = outcome.error_in_exec or outcome.error_before_exec
        raise RuntimeError(f"cell {source!r} failed: {error!r}")


@contextlib.contextmanager
def magic_pool(n: int) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A pool started the notebook way, ``%fsdp start``, in a real IPython shell.

    Yields the pool and a callable that runs a no-op ``%%fsdp`` cell on it; the pool is
    stopped with ``%fsdp stop`` on exit.
    """
    from IPython.core.interactiveshell import InteractiveShell

    from fsdp_interactive.notebook import magics

    shell = InteractiveShell.instance()
    try:
        magics.load_ipython_extension(shell)
        _quiet_cell(shell, f"%fsdp start -n {n} --devices cpu")
        try:
            yield magics.current_pool(), lambda: _quiet_cell(shell, f"%%fsdp\n{NOOP}\n")
        finally:
            _quiet_cell(shell, "%fsdp stop")
    finally:
        InteractiveShell.clear_instance()


def run(settings: Settings) -> FigureResult:
    """Cell dispatch: no-op round trip of ours vs raw ipyparallel vs a torchrun relaunch."""
    result = FigureResult("dispatch", "Cell dispatch (no-op round trip)")
    pool_missing = missing("fsdp_interactive.pool", "Pool")
    magic_missing = pool_missing or magic_unavailable()
    round_trips = 30 if settings.quick else 100
    relaunches = 1 if settings.quick else 3
    result.notes.append(
        f"In-process contenders: {round_trips} round trips each, alternated, after "
        f"{settings.warmup * 5} warm-up calls; torchrun: {relaunches} relaunch(es)."
    )
    for world in settings.world_sizes:
        case = f"{world} ranks"
        with contextlib.ExitStack() as stack:
            raw_view = stack.enter_context(raw_cluster(world))
            contenders: dict[str, Callable[[], Any]] = {
                RAW: lambda view=raw_view: view.execute(NOOP, block=True)
            }
            if not magic_missing:
                active, cell = stack.enter_context(magic_pool(world))
                contenders[POOL] = lambda active=active: active.run(NOOP)
                contenders[MAGIC] = cell
            elif not pool_missing:
                active = stack.enter_context(pool(world))
                contenders[POOL] = lambda active=active: active.run(NOOP)
            stats = measure_interleaved(
                contenders, reps=round_trips, warmup=settings.warmup * 5, unit="s"
            )
        stats[TORCHRUN] = Stat([relaunch(world).total_s for _ in range(relaunches)], "s")
        for name, stat in stats.items():
            result.measurements[f"{case}: {name}"] = stat
        for name, why in ((POOL, pool_missing), (MAGIC, magic_missing)):
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case=case,
                    subject_name=name,
                    reference_name=RAW,
                    subject=stats.get(name),
                    reference=stats[RAW],
                    target=Target("<=", 1.2),
                    unavailable=why,
                )
            )
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case=case,
                    subject_name=name,
                    reference_name=TORCHRUN,
                    subject=stats.get(name),
                    reference=stats[TORCHRUN],
                    target=Target(">=", 500),
                    inverse=True,
                    unavailable=why,
                    note="ratio = how many times faster than a relaunch",
                )
            )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
