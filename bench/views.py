"""Notebook views at real sizes: probe and render seconds at 30, 300 and 3,000 parameters.

``python -m bench.views [--ranks 4] [--sizes 30,300,3000] [--repeats 3] [--out FILE]``
starts a CPU ``Pool`` of ``--ranks`` gloo ranks, builds on it a model of N parameters
(``N / 10`` alike layers of 10 parameters each, one ``fully_shard`` unit per layer, then
the root; width 32, so the parameter count, not the arithmetic, sets the cost), runs
backward and 10 recorded optimizer steps, and times for every view:

* probe: what the view asks of the ranks (``RankModel.layout()``, ``.grad_norms()``,
  ``SummonPanel(source)`` = parameter names + one summon, ``GradNormMonitor.poll()`` of
  10 records, ``Dashboard(source)`` = all of them plus memory);
* render: building the widget from that data (tables as HTML and the PNG picture), what a
  user waits for after the probe.

Each figure is the median of ``--repeats`` runs (the minimum is printed too).  Prints a
Markdown table (the one in docs/benchmarks.md, "Notebook views at real sizes") and writes
the raw samples as JSON to ``--out`` (default ``out/bench_views.json``).  Target: probe and
render each at most 1 s at 300 parameters on 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_SECONDS = 1.0
TARGET_PARAMS = 300

MODEL = """
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from fsdp_interactive.inspect import GradNormRecorder


class BenchLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        h = self.norm(x)
        return x + self.o_proj(self.q_proj(h) * self.k_proj(h).sigmoid() + self.v_proj(h))


torch.manual_seed(0)
bench_model = nn.Sequential(*(BenchLayer(32) for _ in range({layers})))
bench_mesh = init_device_mesh("cpu", (world_size,))
for bench_layer in bench_model:
    fully_shard(bench_layer, mesh=bench_mesh)
fully_shard(bench_model, mesh=bench_mesh)
bench_optim = torch.optim.SGD(bench_model.parameters(), lr=1e-3)
bench_recorder = GradNormRecorder(bench_model).attach(bench_optim)
for bench_step in range(10):
    bench_optim.zero_grad()
    bench_model(torch.randn(4, 32)).square().mean().backward()
    bench_optim.step()
bench_model(torch.randn(4, 32)).square().mean().backward()
"""

VIEWS = ("LayoutView", "GradNormView", "SummonPanel", "GradNormMonitor", "Dashboard")


def _seconds(action: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    value = action()
    return time.perf_counter() - began, value


def measure(source: Any, repeats: int) -> dict[str, dict[str, list[float]]]:
    """``{view: {"probe": [s, ...], "render": [s, ...]}}`` on the model ``source`` names."""
    from fsdp_interactive.notebook import (
        Dashboard,
        GradNormMonitor,
        GradNormView,
        LayoutView,
        SummonPanel,
    )

    probes: dict[str, Callable[[], Any]] = {
        "LayoutView": source.layout,
        "GradNormView": source.grad_norms,
        "SummonPanel": lambda: SummonPanel(source),
        "GradNormMonitor": lambda: _polled(GradNormMonitor(source)),
        "Dashboard": lambda: Dashboard(source),
    }
    renders: dict[str, Callable[[Any], Any]] = {
        "LayoutView": lambda data: LayoutView(data).widget,
        "GradNormView": lambda data: GradNormView(data).widget,
        "SummonPanel": lambda panel: panel.widget,
        "GradNormMonitor": lambda monitor: monitor.widget,
        "Dashboard": lambda dashboard: dashboard.widget,
    }
    samples: dict[str, dict[str, list[float]]] = {}
    for view in VIEWS:
        samples[view] = {"probe": [], "render": []}
        for _ in range(repeats):
            probe_s, data = _seconds(probes[view])
            render_s, _ = _seconds(lambda data=data, render=renders[view]: render(data))
            samples[view]["probe"].append(probe_s)
            samples[view]["render"].append(render_s)
    return samples


def _polled(monitor: Any) -> Any:
    monitor.poll()
    return monitor


def run(ranks: int, sizes: list[int], repeats: int, out: Path | None = None) -> dict[str, Any]:
    """Measure every size; after each, the results so far are written to ``out`` (a long
    run that is stopped keeps what it measured)."""
    from fsdp_interactive.notebook import RankModel
    from fsdp_interactive.pool import Pool

    results: dict[str, Any] = {"ranks": ranks, "repeats": repeats, "sizes": {}}
    results["reference_figure"] = reference_figure_seconds(max(3, repeats))
    pool = Pool(ranks, devices="cpu", show_topology=False).start()
    try:
        for size in sizes:
            if size % 10:
                raise ValueError(
                    f"sizes must be multiples of 10 (10 parameters a layer), got {size}"
                )
            pool.run(MODEL.replace("{layers}", str(size // 10)), stream=False, timeout=900)
            source = RankModel(pool, "bench_model", recorder="bench_recorder", timeout=600)
            results["sizes"][str(size)] = measure(source, repeats)
            pool.run(
                "bench_recorder.detach(); del bench_model, bench_optim, bench_recorder",
                stream=False,
            )
            print(f"measured {size} parameters", flush=True)
            if out is not None:
                out.write_text(json.dumps(results, indent=1), encoding="utf-8")
    finally:
        pool.stop()
    return results


def reference_figure_seconds(repeats: int) -> list[float]:
    """Seconds to render a plain 7x3-inch line plot as PNG: the machine's yardstick, to
    compare render times across machines and loads.  The first render, which fills
    matplotlib's font cache, is not counted."""
    from matplotlib.figure import Figure

    from fsdp_interactive.notebook._format import figure_png

    def render() -> None:
        figure = Figure(figsize=(7, 3), layout="tight")
        axes = figure.subplots()
        axes.plot(range(20), [i * i for i in range(20)])
        axes.set_title("reference")
        figure_png(figure)

    render()
    return [_seconds(render)[0] for _ in range(repeats)]


def markdown(results: dict[str, Any]) -> str:
    """The table of medians (min in brackets), seconds; over-target cells marked."""
    sizes = list(results["sizes"])
    header = "| view | " + " | ".join(f"probe {s} | render {s}" for s in sizes) + " |"
    rule = "|---|" + "---:|---:|" * len(sizes)
    lines = [header, rule]
    for view in VIEWS:
        cells = []
        for size in sizes:
            for part in ("probe", "render"):
                values = results["sizes"][size][view][part]
                median = statistics.median(values)
                over = int(size) == TARGET_PARAMS and median > TARGET_SECONDS
                cells.append(
                    f"{'**' if over else ''}{median:.2f}{'**' if over else ''} ({min(values):.2f})"
                )
        lines.append(f"| {view} | " + " | ".join(cells) + " |")
    reference = statistics.median(results["reference_figure"])
    lines.append("")
    lines.append(
        f"Reference figure (plain 7x3-inch line plot to PNG) on this machine: {reference:.2f} s."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.views", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", default="30,300,3000", help="parameter counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO_ROOT / "out" / "bench_views.json"))
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = run(args.ranks, sizes, args.repeats, out)
    results["machine"] = f"{platform.machine()}, {platform.python_version()}"
    out.write_text(json.dumps(results, indent=1), encoding="utf-8")
    print(markdown(results))
    at_target = results["sizes"].get(str(TARGET_PARAMS))
    if at_target is not None:
        worst = max(statistics.median(v) for parts in at_target.values() for v in parts.values())
        print(
            f"\nslowest median at {TARGET_PARAMS} parameters: {worst:.2f} s (target {TARGET_SECONDS} s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
