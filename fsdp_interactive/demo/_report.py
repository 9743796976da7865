"""The demo's one-page PNG report: loss curve, memory per rank, gradient norms per module."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from fsdp_interactive.demo._result import DemoResult
from fsdp_interactive.notebook.plots import rank_color

_MIB = 1024 * 1024


def shallow_modules(modules: dict[str, float], depth: int = 1) -> dict[str, float]:
    """The norms of modules at most ``depth`` dots deep, without the containers
    (``blocks``) whose children are listed themselves; the root ("") is left out."""
    shown = [name for name in modules if name and name.count(".") <= depth]
    return {
        name: modules[name]
        for name in shown
        if not any(other.startswith(name + ".") for other in shown)
    }


def write_report(result: DemoResult, path: str | Path) -> Path:
    """Draw ``result`` into a PNG at ``path`` (created or replaced) and return the path."""
    figure = Figure(figsize=(13, 4))
    loss_ax, memory_ax, norm_ax = figure.subplots(1, 3, gridspec_kw={"width_ratios": [3, 2, 3]})

    steps = range(1, len(result.losses) + 1)
    loss_ax.plot(steps, result.losses, color="#1f77b4")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("mean loss over ranks")
    loss_ax.set_title(f"training loss ({result.world_size} ranks)")
    loss_ax.grid(alpha=0.3)

    if result.layout is not None:
        totals = result.layout.ranks
        labels = [f"rank {t.rank}" for t in totals]
        bottom = [0.0] * len(totals)
        for label, attr, hatch in (
            ("params", "param_bytes", ""),
            ("grads", "grad_bytes", ".."),
            ("optimizer", "optim_bytes", "xx"),
        ):
            values = [getattr(t, attr) / _MIB for t in totals]
            memory_ax.bar(
                labels,
                values,
                bottom=bottom,
                label=label,
                hatch=hatch,
                color=[rank_color(t.rank) for t in totals],
                edgecolor="black",
            )
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        full = result.layout.model_bytes / _MIB
        memory_ax.axhline(full, ls="--", color="gray", label="unsharded params")
        memory_ax.set_ylabel("MiB")
        memory_ax.set_title("memory per rank")
        memory_ax.set_ylim(0, max(max(bottom), full) * 1.35)
        memory_ax.legend(fontsize=7, ncol=2, loc="upper center")

    if result.grad_norms is not None:
        modules = shallow_modules(result.grad_norms.modules)
        names = list(modules)[:16]
        norm_ax.barh(names[::-1], [modules[n] for n in names[::-1]], color="#2ca02c")
        norm_ax.set_xlabel("gradient L2 norm (last step)")
        norm_ax.set_title(f"gradient norms, global {result.grad_norms.total:.3g}")
        norm_ax.tick_params(axis="y", labelsize=7)

    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    return path
