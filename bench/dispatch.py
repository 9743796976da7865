"""Figure 1, cell dispatch: the round trip of a cell on every rank, at 1 to 8 ranks.

Contenders, at each world size ``N``:

* raw ipyparallel: ``DirectView.execute("pass", block=True)`` on a plain ``ipyparallel``
  cluster of ``N`` engines (the reference), and ipyparallel's own ``%%px --block`` cell
  magic on that cluster, in the same IPython shell as ours;
* a ``%%fsdp`` cell whose body is ``pass``, run by a real IPython shell with the
  extension loaded, on a pool started with ``%fsdp start -n N --devices cpu`` (ours);
* ``Pool.run("pass")`` on that same pool (ours);
* a cell that prints 1 MiB (16,384 lines of 64 bytes) on every rank: ``%%fsdp`` (ours,
  which shows rank 0's output and every rank's errors) against ``%%px --block`` (raw
  ipyparallel, which shows every rank's output); the shell's output goes to memory;
* relaunching the same trivial script with torchrun (``bench/scripts/noop_rank.py``:
  join the process group, run ``pass``, leave), timed launch to exit.

The in-process contenders are timed alternately (the order rotating from round to
round), one round trip per sample, after warm-up calls; the ratios pair each sample
with the reference's sample of the same round.  Targets: ours <= 1.2x raw ipyparallel
at every world size, like for like (``Pool.run`` against ``DirectView.execute``, a
``%%fsdp`` cell against a ``%%px`` cell); ours >= 500x faster than a torchrun relaunch.
Two rows without a target show what a cell magic costs over a bare call, IPython's cell
machinery (transform, compile, argument parsing, output capture), for ``%%fsdp`` and for
``%%px`` alike.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

from bench.availability import missing
from bench.runner import (
    Comparison,
    Curve,
    FigureResult,
    Settings,
    Stat,
    Target,
    figure_main,
    measure_interleaved,
)
from bench.torchrun import relaunch

RAW = "raw ipyparallel DirectView.execute"
PX = "%%px cell (raw ipyparallel)"
POOL = "Pool.run (ours)"
MAGIC = "%%fsdp cell (ours)"
TORCHRUN = "torchrun relaunch"
PX_PRINT = "%%px cell printing 1 MiB per rank (raw ipyparallel)"
MAGIC_PRINT = "%%fsdp cell printing 1 MiB per rank (ours)"
NOOP = "pass"
PRINT_1MIB = 'print(("x" * 63 + "\\n") * 16384, end="")'
DISPATCH_TARGET = Target("<=", 1.2)


@contextlib.contextmanager
def raw_cluster(n: int) -> Iterator[Any]:
    """A plain ipyparallel cluster of ``n`` engines; yields a DirectView on all of them."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=n, log_level=40)
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(n, timeout=180, interactive=False)
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


def quiet_cell(shell: Any, source: str) -> None:
    """Run ``source`` in ``shell`` with its output going to memory; raise if it fails."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        outcome = shell.run_cell(source, store_history=False)
    if not outcome.success:
        error = outcome.error_in_exec or outcome.error_before_exec
        raise RuntimeError(f"cell {source!r} failed: {error!r}")


@contextlib.contextmanager
def ipython_shell() -> Iterator[Any]:
    """A real IPython shell (the process-wide instance), cleared on exit."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        yield shell
    finally:
        InteractiveShell.clear_instance()


@contextlib.contextmanager
def magic_pool(shell: Any, n: int) -> Iterator[Any]:
    """A pool started the notebook way, ``%fsdp start``, in ``shell``; yields the pool.

    The pool is stopped with ``%fsdp stop`` on exit.
    """
    from fsdp_interactive.notebook import magics

    magics.load_ipython_extension(shell)
    quiet_cell(shell, f"%fsdp start -n {n} --devices cpu")
    try:
        yield magics.current_pool()
    finally:
        quiet_cell(shell, "%fsdp stop")


def _world_contenders(
    stack: contextlib.ExitStack, shell: Any, world: int, magic_missing: str | None
) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """(no-op contenders, 1 MiB print contenders) at one world size."""
    raw_view = stack.enter_context(raw_cluster(world))
    raw_view.activate()  # %%px in this shell, on the raw cluster
    noop: dict[str, Callable[[], Any]] = {
        RAW: lambda: raw_view.execute(NOOP, block=True),
        PX: lambda: quiet_cell(shell, f"%%px --block\n{NOOP}\n"),
    }
    printing: dict[str, Callable[[], Any]] = {
        PX_PRINT: lambda: quiet_cell(shell, f"%%px --block\n{PRINT_1MIB}\n"),
    }
    if not magic_missing:
        active = stack.enter_context(magic_pool(shell, world))
        noop[POOL] = lambda: active.run(NOOP)
        noop[MAGIC] = lambda: quiet_cell(shell, f"%%fsdp\n{NOOP}\n")
        printing[MAGIC_PRINT] = lambda: quiet_cell(shell, f"%%fsdp\n{PRINT_1MIB}\n")
    return noop, printing


def run(settings: Settings) -> FigureResult:
    """Cell dispatch: round trip of ours vs raw ipyparallel vs a torchrun relaunch."""
    result = FigureResult("dispatch", "Cell dispatch (round trip of a cell on every rank)")
    magic_missing = missing("fsdp_interactive.pool", "Pool") or magic_unavailable()
    round_trips = 30 if settings.quick else 200
    print_trips = 10 if settings.quick else 30
    relaunches = 1 if settings.quick else 3
    worlds = settings.scaling_worlds
    result.notes.append(
        f"No-op contenders: {round_trips} round trips each, alternated, after "
        f"{settings.warmup * 5} warm-up calls; 1 MiB print contenders: {print_trips} each; "
        f"torchrun: {relaunches} relaunch(es) per world size. World sizes: "
        f"{', '.join(map(str, worlds))}; above 2 ranks the ranks outnumber this machine's "
        "cores, so absolute times include waiting to be scheduled (ratios at the same world "
        "size stay comparable)."
    )
    per_world: dict[int, dict[str, Stat]] = {}
    for world in worlds:
        with ipython_shell() as shell, contextlib.ExitStack() as stack:
            noop, printing = _world_contenders(stack, shell, world, magic_missing)
            stats = measure_interleaved(noop, reps=round_trips, warmup=settings.warmup * 5)
            stats.update(measure_interleaved(printing, reps=print_trips, warmup=settings.warmup))
        stats[TORCHRUN] = Stat([relaunch(world).total_s for _ in range(relaunches)], "s")
        per_world[world] = stats
        case = f"{world} rank{'s' if world > 1 else ''}"
        for name, stat in stats.items():
            result.measurements[f"{case}: {name}"] = stat
        compare = _comparer(result, case, stats)
        for name, reference in ((POOL, RAW), (MAGIC, PX), (MAGIC_PRINT, PX_PRINT)):
            compare(name, reference, target=DISPATCH_TARGET, unavailable=magic_missing, paired=True)
        for name in (MAGIC, PX):
            compare(
                name,
                RAW,
                target=None,
                unavailable=magic_missing if name == MAGIC else None,
                note="no target: what a cell magic adds to a bare call",
                paired=True,
            )
        for name in (POOL, MAGIC):
            compare(
                name,
                TORCHRUN,
                target=Target(">=", 500),
                inverse=True,
                unavailable=magic_missing,
                note="ratio = how many times faster than a relaunch",
            )
    result.curves += _curves(result.key, per_world)
    return result


def _comparer(result: FigureResult, case: str, stats: dict[str, Stat]) -> Callable[..., None]:
    """``compare(subject, reference, **options)``: add that comparison of ``stats`` to
    ``result`` for ``case`` (``options``: :class:`Comparison`'s target, note, ...)."""

    def compare(name: str, reference: str, **options: Any) -> None:
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=case,
                subject_name=name,
                reference_name=reference,
                subject=stats.get(name),
                reference=stats[reference],
                **options,
            )
        )

    return compare


def _curves(key: str, per_world: dict[int, dict[str, Stat]]) -> list[Curve]:
    worlds = sorted(per_world)
    panels = {
        "No-op cell": [
            (RAW, None, False),
            (PX, None, False),
            (POOL, RAW, True),
            (MAGIC, PX, True),
            (TORCHRUN, None, False),
        ],
        "Cell printing 1 MiB on every rank": [
            (PX_PRINT, None, False),
            (MAGIC_PRINT, PX_PRINT, True),
        ],
    }
    curves = []
    for panel, members in panels.items():
        for name, reference, ours in members:
            present = [w for w in worlds if name in per_world[w]]
            if not present:
                continue
            curves.append(
                Curve(
                    figure=key,
                    panel=panel,
                    name=name,
                    x_label="ranks",
                    xs=[float(w) for w in present],
                    values=[per_world[w][name] for w in present],
                    reference=reference,
                    target=DISPATCH_TARGET if reference else None,
                    ours=ours,
                    paired=reference is not None,
                )
            )
    return curves


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
