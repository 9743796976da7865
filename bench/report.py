"""Turn figure results into ``benchmarks.md``, ``benchmarks.png`` and ``benchmarks.json``.

:func:`write_report` writes the three files into one folder: the JSON holds every raw
sample (it is what the report was rendered from), the Markdown holds the machine, the
versions, the date, the summary table of ratios against targets, per-figure
measurements, the profiled causes of missed targets (from ``bench/findings.md``) and how
to reproduce; the PNG plots every ratio against its target.  Missing components appear
as "not available yet" rows without numbers.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import textwrap
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import findings as findings_file
from bench.curves_report import curves_markdown, render_curves
from bench.runner import Comparison, FigureResult, Stat

REPO_ROOT = Path(__file__).resolve().parent.parent
SCALING_PLOT = "benchmarks_scaling.png"


@dataclass
class RunInfo:
    """When, where and with what a run happened."""

    started: str
    finished: str
    quick: bool
    command: str
    machine: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    load_before: str = ""
    load_after: str = ""

    @classmethod
    def collect(cls, quick: bool, command: str) -> RunInfo:
        return cls(
            started=_now(),
            finished="",
            quick=quick,
            command=command,
            machine=machine_description(),
            versions=versions(),
            load_before=_load(),
        )

    def finish(self) -> None:
        self.finished = _now()
        self.load_after = _load()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def now_and_load() -> str:
    """ "2026-12-03 13:10:04 UTC (load average 1.52 1.61 2.03)": when, and how busy."""
    return f"{_now()} (load average {_load()})"


def _load() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "unknown"


def machine_description() -> dict[str, str]:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical cores": str(os.cpu_count()),
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "gpu": "none (CPU ranks, gloo)",
    }


def versions() -> dict[str, str]:
    import ipyparallel
    import torch

    import fsdp_interactive

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "fsdp_interactive", "bench"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if dirty:
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ipyparallel": ipyparallel.__version__,
        "fsdp_interactive": f"{fsdp_interactive.__version__}, commit {commit}",
    }


# ---------------------------------------------------------------------------- formatting


def fmt_value(value: float, unit: str) -> str:
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.0f} µs"
        if value < 1.0:
            return f"{value * 1e3:.1f} ms"
        return f"{value:.2f} s"
    if unit == "B":
        return f"{value / 2**20:.2f} MiB"
    if unit == "B/s":
        return f"{value / 2**20:.0f} MiB/s"
    return f"{value:.3g} {unit}"


def fmt_stat(stat: Stat | None) -> str:
    if stat is None:
        return "—"
    if len(stat.samples) == 1:
        return fmt_value(stat.median, stat.unit)
    return (
        f"{fmt_value(stat.median, stat.unit)} "
        f"[{fmt_value(stat.min, stat.unit)} to {fmt_value(stat.max, stat.unit)}]"
    )


def fmt_ratio(comparison: Comparison) -> str:
    if comparison.unavailable:
        return "not available yet"
    ratio = comparison.ratio
    if ratio is None:
        return "—"
    if ratio >= 100:
        return f"{ratio:.0f}x"
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.3f}x"


def verdict(comparison: Comparison) -> str:
    """ "met", "**missed**", "unresolved [low, high]" (the noise straddles the target)."""
    if comparison.unavailable:
        return "—"
    outcome = comparison.verdict
    if outcome is None:
        return "n/a"
    if outcome == "unresolved":
        low, high = comparison.interval or (comparison.ratio, comparison.ratio)
        return f"unresolved [{low:.3f}, {high:.3f}]"
    return "met" if outcome == "met" else "**missed**"


def ratio_range(comparison: Comparison) -> tuple[float, float] | None:
    """The widest ratio the samples allow: (low, high), or None without both sides."""
    s, r = comparison.subject, comparison.reference
    if s is None or r is None or not s.min or not r.min:
        return None
    low, high = s.min / r.max, s.max / r.min
    if comparison.inverse:
        low, high = r.min / s.max, r.max / s.min
    return low, high


# ---------------------------------------------------------------------------- markdown


def render_markdown(
    info: RunInfo,
    figures: list[FigureResult],
    plot_name: str,
    findings: findings_file.Findings | None = None,
) -> str:
    """The report's Markdown; ``findings`` defaults to ``bench/findings.md``."""
    findings = findings if findings is not None else findings_file.load()
    lines: list[str] = []
    add = lines.append
    mode = "quick mode (smoke test sizes; not for conclusions)" if info.quick else "full mode"
    add("# Benchmarks")
    add("")
    add(
        "How fast the kit is next to the tools it replaces: relaunching scripts with torchrun, "
        "raw ipyparallel, torch's own FSDP1 and `fully_shard` applied by hand. "
        "Generated by `bench/` (do not edit by hand; rerun the command below)."
    )
    add("")
    add(f"- Run: {info.started} to {info.finished}, {mode}.")
    add(f"- Command: `{info.command}`")
    add(
        "- Machine: "
        + ", ".join(f"{k} {v}" for k, v in info.machine.items())
        + f"; load average (1/5/15 min) {info.load_before} before, {info.load_after} after."
    )
    add("- Versions: " + ", ".join(f"{k} {v}" for k, v in info.versions.items()) + ".")
    add("")
    add(
        "**Read the ratios, not the absolute numbers.** Every figure is a side-by-side "
        "ratio measured in this one run, contenders alternated sample by sample, because the "
        "machine is small and shared (other work ran at the same time, see the load "
        "average). Each value is the median of several repetitions after warm-up, with the "
        "min and max of the samples in brackets. Where two contenders were alternated round "
        "by round, the ratio is the median of the per-round ratios (which cancels the "
        "machine's drift between rounds), else the ratio of the medians. A result is `met` "
        "or `missed` only when the ratio's 95% confidence interval (two order statistics of "
        "the per-round ratios; unpaired, the widest ratio the two medians' intervals allow) "
        "lies wholly on one side of the target, and `unresolved [low, high]` otherwise: the "
        "noise of the run cannot tell. The summary plot's whiskers show the widest ratio "
        "the samples' min and max allow; the scaling plot's show the intervals. Rows named "
        "A/A control compare two identical contenders: their distance from 1 is the run's "
        "noise floor."
    )
    add("")
    add("## Summary")
    add("")
    add("| Figure | Case | Ours (or baseline) | Reference | Ratio | Target | Result |")
    add("| --- | --- | --- | --- | --- | --- | --- |")
    for figure in figures:
        if figure.error:
            add(f"| {figure.title} | — | failed: see below | — | — | — | **error** |")
            continue
        for c in figure.comparisons:
            subject = (
                f"{c.subject_name}: {c.unavailable}"
                if c.unavailable
                else f"{c.subject_name}: {fmt_stat(c.subject)}"
            )
            reference = f"{c.reference_name}: {fmt_stat(c.reference)}"
            note = f" ({c.note})" if c.note else ""
            add(
                f"| {figure.title} | {c.case}{note} | {subject} | {reference} | "
                f"{fmt_ratio(c)} | {c.target or 'n/a'} | {verdict(c)} |"
            )
    add("")
    add(f"![Ratios against targets]({plot_name})")
    add("")
    lines += curves_markdown(figures, SCALING_PLOT)
    missed = [
        (figure, c)
        for figure in figures
        for c in figure.comparisons
        if c.met is False and not c.note.startswith("baseline")
    ]
    add("## Missed targets and their causes")
    add("")
    if not missed:
        add("No target of ours was missed in this run.")
    groups: dict[tuple[str, str, str], list[tuple[FigureResult, Comparison]]] = {}
    for figure, c in missed:
        groups.setdefault((figure.key, c.subject_name, c.reference_name), []).append((figure, c))
    for key, members in groups.items():
        figure = members[0][0]
        cases = "; ".join(f"{c.case}: {fmt_ratio(c)}" for _, c in members)
        target = members[0][1].target
        add(
            f"- **{figure.title}: {key[1]} vs {key[2]}** (target {target}; {cases}): "
            + (findings.causes.get(key) or "no profile of this miss is recorded yet.")
        )
    add("")
    for figure in figures:
        add(f"## {figure.title}")
        add("")
        doc = _figure_doc(figure.key)
        if doc:
            add(doc)
            add("")
        if figure.error:
            add("This figure failed in this run:")
            add("")
            add("```text")
            add(figure.error.rstrip())
            add("```")
            add("")
            continue
        if figure.measured:
            add(f"- Measured {figure.measured}.")
        for note in figure.notes:
            add(f"- {note}")
        if figure.notes:
            add("")
        if figure.key in findings.observations:
            add(f"Profiled: {findings.observations[figure.key]}")
            add("")
        add("| Measurement | Median | Min | Max | Samples |")
        add("| --- | --- | --- | --- | --- |")
        for name, stat in figure.measurements.items():
            add(
                f"| {name} | {fmt_value(stat.median, stat.unit)} | "
                f"{fmt_value(stat.min, stat.unit)} | {fmt_value(stat.max, stat.unit)} | "
                f"{len(stat.samples)} |"
            )
        add("")
        add(f"Figure time: {figure.seconds:.0f} s.")
        add("")
    add("## Not measured here")
    add("")
    if not any(f.key == "gpu" and not f.error for f in figures):
        add(
            "- CUDA/NCCL figures are not measured yet: no GPU was available, so every figure "
            "above uses CPU ranks with gloo. On a host with at least two CUDA devices, "
            "`make bench-gpu` (`python -m bench --gpu`, then `pytest -m cuda`) measures NCCL "
            "dispatch, start, steps/s, MFU and memory per device of ours against torch FSDP1 "
            "and `fully_shard` by hand, merges them into this report and runs every "
            "CUDA-marked test. Sharded training needs two GPUs or more: NCCL refuses two "
            "ranks on one device, and at world size 1 torch's FSDP1 switches FULL_SHARD to "
            "NO_SHARD."
        )
    add(
        "- The `%%fsdp` round trip is measured in a real IPython shell inside the benchmark "
        "process, not through a Jupyter kernel: the kernel's own ZMQ message from the "
        "notebook front end is not included (it is the same for `%%px` and raw "
        "ipyparallel)."
    )
    add(
        "- Async checkpoint saves on GPU ranks (where staging is a device-to-host copy), "
        "multi-node pools and NCCL collectives: not available on this machine."
    )
    add("")
    add("## How to reproduce")
    add("")
    add("```bash")
    add("make bench                              # full run, rewrites docs/benchmarks.*")
    add(".venv/bin/python -m bench               # the same, once `make setup` has run")
    add(".venv/bin/python -m bench --quick --out /tmp/bench   # < 2 min smoke run")
    add(".venv/bin/python -m bench --only dispatch,cold_start  # some figures only")
    add(".venv/bin/python -m bench.train_step --quick          # one figure, JSON on stdout")
    add("```")
    add("")
    add(
        "Every multi-rank figure starts its own processes (spawned gloo ranks, torchrun, "
        "ipyparallel clusters, pools) and stops exactly those. Ranks run with one intra-op "
        "thread each. The raw samples of this run are in `benchmarks.json` next to this file."
    )
    add("")
    return "\n".join(lines)


def _figure_doc(key: str) -> str:
    """The figure module's docstring minus its title line, as Markdown."""
    import importlib

    try:
        module = importlib.import_module(f"bench.{key}")
    except ImportError:
        return ""
    paragraphs = (module.__doc__ or "").strip().split("\n\n")[1:]
    return "\n\n".join(_paragraph_markdown(p) for p in paragraphs)


def _paragraph_markdown(paragraph: str) -> str:
    """Join wrapped lines; keep ``* `` bullets as Markdown list items; RST code to Markdown."""
    items: list[str] = []
    for line in paragraph.splitlines():
        stripped = line.strip()
        if stripped.startswith("* ") or not items:
            items.append(stripped)
        else:
            items[-1] += " " + stripped
    text = "\n".join("- " + i[2:] if i.startswith("* ") else i for i in items)
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


# ---------------------------------------------------------------------------- plot


def render_plot(figures: list[FigureResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [f for f in figures if f.comparisons or f.error]
    heights = [0.5 * max(len(f.comparisons), 1) + 0.9 for f in shown]
    fig, axes = plt.subplots(
        len(shown) or 1,
        1,
        figsize=(12, sum(heights) + 0.8),
        gridspec_kw={"height_ratios": heights or [1]},
        squeeze=False,
    )
    for ax, figure in zip(axes.flat, shown, strict=False):
        _plot_figure(ax, figure)
    fig.suptitle(
        "fsdp_interactive benchmarks: ratio of medians (bar), target (dashed), "
        "min-max span (whiskers); pale bars are baselines"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.subplots_adjust(left=0.33)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_figure(ax: Any, figure: FigureResult) -> None:
    ax.set_title(figure.title, fontsize=10, loc="left")
    if figure.error:
        ax.text(0.5, 0.5, "figure failed (see report)", ha="center", va="center", color="red")
        ax.set_axis_off()
        return
    comparisons = figure.comparisons
    labels = []
    ratios = [c.ratio for c in comparisons if c.ratio]
    targets = [c.target.value for c in comparisons if c.target]
    span = [v for v in ratios + targets if v and v > 0]
    log = bool(span) and max(span) / min(span) > 30
    if log:
        ax.set_xscale("log")
    top = max(span) * (3 if log else 1.25) if span else 1.0
    for y, c in enumerate(comparisons):
        labels.append(_short_label(c))
        if c.unavailable or c.ratio is None:
            ax.text(
                (min(span) if span else 0.5) if log else 0.02 * top,
                y,
                "not available yet" if c.unavailable else "no ratio",
                va="center",
                fontsize=8,
                color="grey",
            )
            continue
        color = {True: "tab:green", False: "tab:red", None: "tab:grey"}[c.met]
        if c.note.startswith("baseline"):
            color = {True: "#9fd39f", False: "#f0a0a0", None: "lightgrey"}[c.met]
        ax.barh(y, c.ratio, color=color, height=0.6)
        bounds = ratio_range(c)
        if bounds:
            ax.errorbar(
                c.ratio,
                y,
                xerr=[[c.ratio - bounds[0]], [bounds[1] - c.ratio]],
                fmt="none",
                ecolor="black",
                capsize=3,
                lw=1,
            )
        ax.text(c.ratio, y + 0.32, f" {fmt_ratio(c)}", va="center", fontsize=7)
        if c.target:
            ax.plot(
                [c.target.value] * 2,
                [y - 0.4, y + 0.4],
                color="black",
                lw=2,
                ls="--",
            )
    ax.set_yticks(range(len(comparisons)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(right=top)
    if log:
        ax.set_xlim(left=min(span) / 3)
    else:
        ax.set_xlim(left=0)
    ax.set_xlabel("ratio (dashed: target)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def _short_label(c: Comparison) -> str:
    subject = c.subject_name.replace(" (ours)", "*")
    reference = c.reference_name
    for long, short in (
        ("raw ipyparallel DirectView.execute", "raw ipyparallel"),
        ("torch.save of a full state dict from rank 0", "torch.save rank 0"),
        ("fsdp_interactive.checkpoint.", ""),
        ("FullyShardedDataParallel", "FSDP"),
        (" (device_id=cpu)", ""),
        (", blocking part", " blocking"),
    ):
        subject = subject.replace(long, short)
        reference = reference.replace(long, short)
    case = (
        c.case.replace("meta-device init", "meta init")
        .replace(", peak RSS increase", "")
        .replace("params+grads+optimizer", "held")
    )
    return textwrap.fill(f"{case}: {subject} vs {reference}", width=52)


# ---------------------------------------------------------------------------- files


def write_report(info: RunInfo, figures: list[FigureResult], out_dir: Path) -> dict[str, Path]:
    """Write benchmarks.{json,md,png} into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "benchmarks.json",
        "md": out_dir / "benchmarks.md",
        "png": out_dir / "benchmarks.png",
    }
    payload = {
        "info": info.__dict__,
        "figures": [figure.to_dict() for figure in figures],
    }
    paths["json"].write_text(json.dumps(payload, indent=1) + "\n")
    render_plot(figures, paths["png"])
    scaling = out_dir / SCALING_PLOT
    if render_curves(figures, scaling):
        paths["scaling_png"] = scaling
    text = render_markdown(info, figures, paths["png"].name)
    paths["md"].write_text(text + _kept_sections(paths["md"]))
    return paths


# Sections of benchmarks.md written by other commands (their own headings say how); a
# rerun of the report keeps them, from their heading to the end of the file.
KEPT_SECTIONS = ("## Notebook views at real sizes", "## Two hosts x two ranks")


def _kept_sections(md: Path) -> str:
    if not md.is_file():
        return ""
    old = md.read_text()
    starts = [old.find(f"\n{heading}") for heading in KEPT_SECTIONS]
    starts = [s for s in starts if s >= 0]
    return old[min(starts) :].rstrip("\n") + "\n" if starts else ""


def load_results(path: Path) -> tuple[RunInfo, list[FigureResult]]:
    """Read back a ``benchmarks.json`` (to re-render the report without re-measuring)."""
    payload = json.loads(Path(path).read_text())
    info = RunInfo(**payload["info"])
    return info, [FigureResult.from_dict(f) for f in payload["figures"]]
