"""``python -m bench``: run every benchmark figure and write the report.

Options: ``--quick`` (small sizes, few repetitions: the CI smoke run, under two minutes),
``--out DIR`` (default ``docs/``: writes ``benchmarks.md``, ``benchmarks-appendix.md``,
the plots and the raw samples ``benchmarks.json``), ``--only a,b`` (a subset of figures,
by key; the figures of :data:`ON_REQUEST` run only when named here),
``--samples N`` (alternated one-step samples per contender of the training-step and
recorder-cost figures, default 200), ``--render-only`` (re-render the report from an existing ``benchmarks.json``),
``--gpu`` (the CUDA/NCCL figure, :mod:`bench.gpu`, merged into the report),
``--merge`` (with ``--only``: keep the other figures of ``OUT/benchmarks.json`` and
replace only those measured now; each figure's section says when it was measured).
A figure that fails is reported as failed (with its traceback) and the others still run;
the exit status is then 1.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
import traceback
from pathlib import Path

from bench.report import load_results, write_report
from bench.run_info import REPO_ROOT, RunInfo, now_and_load
from bench.runner import FigureResult, Settings

# Figure keys in report order; each is a module ``bench.<key>`` with ``run(Settings)``.
FIGURES: tuple[str, ...] = (
    "dispatch",
    "cold_start",
    "death",
    "probes",
    "train_step",
    "memory",
    "grad_norm",
    "checkpoint",
    "debug_cost",
    "state_scaling",
    "hang_watch",
    "attach",
)
#: Figures too long for every run (minutes of GPT-2 small or torchrun launches on fresh
#: processes each): run by ``--only recovery --merge`` (or ``snapshot_cost``,
#: ``script_runs``), which replaces the figure in ``benchmarks.json`` and re-renders the
#: report around it.
ON_REQUEST: tuple[str, ...] = ("recovery", "snapshot_cost", "script_runs")
#: Every figure key, in report order.
REPORT_ORDER: tuple[str, ...] = (*FIGURES, *ON_REQUEST, "gpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run the fsdp_interactive benchmarks and write docs/benchmarks.md.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "docs",
        help="folder for benchmarks.md/.png/.json (default: docs/)",
    )
    parser.add_argument(
        "--only",
        type=_figure_list,
        default=FIGURES,
        help=f"comma-separated figure keys out of {','.join(FIGURES + ON_REQUEST)}",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="run the GPU figure (needs 2+ CUDA devices) and merge it into OUT's report",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the figures of OUT/benchmarks.json that this run does not measure",
    )
    parser.add_argument(
        "--samples",
        type=_positive,
        default=None,
        help="alternated one-step samples per contender of the train_step and grad_norm "
        "figures (default 200, 6 with --quick)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="re-render the report from OUT/benchmarks.json without measuring",
    )
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--samples expects a positive integer, got {text!r}")
    return value


def _figure_list(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in FIGURES + ON_REQUEST]
    if not keys or unknown:
        raise argparse.ArgumentTypeError(
            f"--only expects figure keys out of {', '.join(FIGURES + ON_REQUEST)}; got {text!r}"
        )
    return keys


def run_figure(key: str, settings: Settings) -> FigureResult:
    """Run one figure; a failure becomes a FigureResult carrying the traceback."""
    module = importlib.import_module(f"bench.{key}")
    began = now_and_load()
    start = time.perf_counter()
    try:
        result = module.run(settings)
    except Exception:
        result = FigureResult(key, key, error=traceback.format_exc())
        title = (module.__doc__ or key).strip().splitlines()[0]
        result.title = title.split(":", 1)[1].strip().split(":")[0] if ":" in title else key
    result.seconds = time.perf_counter() - start
    result.measured = f"from {began} to {now_and_load()}"
    return result


def _merged(previous: Path, measured: list[FigureResult]) -> list[FigureResult]:
    """``measured`` plus the figures of ``previous`` it does not replace, in report order."""
    if not previous.is_file():
        return measured
    info, kept = load_results(previous)
    for figure in kept:
        if not figure.measured:
            figure.measured = (
                f"in an earlier run, from {info.started} (load average {info.load_before}) to "
                f"{info.finished} (load average {info.load_after})"
            )
            figure.command = figure.command or info.command
    by_key = {f.key: f for f in kept}
    by_key.update({f.key: f for f in measured})
    order = {key: index for index, key in enumerate(REPORT_ORDER)}
    return sorted(by_key.values(), key=lambda f: order.get(f.key, len(order)))


def _command(argv: list[str] | None) -> str:
    """The command line of this run, as the report names it."""
    return ("python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.render_only:
        results = args.out / "benchmarks.json"
        if not results.is_file():
            parser.error(f"--render-only needs {results} from an earlier run; it does not exist")
        info, figures = load_results(results)
        paths = write_report(info, figures, args.out, command=_command(argv))
        print(f"re-rendered {paths['md']} and {paths['png']}")
        return 0
    if args.gpu:
        args.only, args.merge = ("gpu",), True
    command = _command(argv)
    settings = Settings(quick=args.quick, samples=args.samples)
    info = RunInfo.collect(quick=args.quick, command=command)
    figures = []
    for key in args.only:
        print(f"[bench] {key} ...", flush=True)
        result = run_figure(key, settings)
        result.command = command
        status = "FAILED" if result.error else "done"
        print(f"[bench] {key} {status} in {result.seconds:.0f} s", flush=True)
        if result.error:
            print(result.error, file=sys.stderr, flush=True)
        figures.append(result)
    info.finish()
    if args.merge:
        figures = _merged(args.out / "benchmarks.json", figures)
    paths = write_report(info, figures, args.out)
    print(f"[bench] wrote {paths['md']}, {paths['png']} and {paths['json']}")
    return 1 if any(f.error for f in figures) else 0


if __name__ == "__main__":
    raise SystemExit(main())
