"""Notebook side of the demo: start a pool, drive the rank job, print and plot the results."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from fsdp_interactive._text import human_bytes, text_table
from fsdp_interactive.demo import _rank_job
from fsdp_interactive.demo._demo_config import DemoConfig
from fsdp_interactive.demo._report import shallow_modules, write_report
from fsdp_interactive.demo._result import DemoResult
from fsdp_interactive.inspect import ModelLayout, merge_layouts

_BAR_WIDTH = 30


def _progress(out: TextIO, done: int, total: int, loss: float, started: float) -> None:
    """One progress line: redrawn in place on a terminal, appended elsewhere (logs, CI)."""
    filled = round(_BAR_WIDTH * done / total)
    rate = done / max(time.monotonic() - started, 1e-9)
    line = (
        f"  [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] step {done}/{total}"
        f"  loss {loss:.4f}  {rate:.1f} steps/s"
    )
    interactive = getattr(out, "isatty", lambda: False)()
    out.write(f"\r{line}" if interactive else f"{line}\n")
    if interactive and done == total:
        out.write("\n")
    out.flush()


def _layout_summary(layout: ModelLayout, largest: int = 6) -> str:
    """The per-rank memory table and the ``largest`` parameters' slices."""
    head = (
        f"{len(layout.params)} parameters, {human_bytes(layout.model_bytes)} unsharded, "
        f"over {layout.world_size} ranks; the {largest} largest:"
    )
    params = sorted(layout.params, key=lambda p: p.nbytes, reverse=True)[:largest]
    param_rows = [
        (
            p.fqn,
            "x".join(map(str, p.global_shape)),
            ",".join(p.placements),
            " | ".join(f"r{s.rank}:{'x'.join(map(str, s.local_shape))}" for s in p.slices),
        )
        for p in params
    ]
    rank_rows = [
        (
            f"rank {t.rank}",
            human_bytes(t.param_bytes),
            human_bytes(t.grad_bytes),
            human_bytes(t.optim_bytes),
            human_bytes(t.total_bytes),
        )
        for t in layout.ranks
    ]
    return "\n\n".join(
        [
            head,
            text_table(("parameter", "shape", "placements", "per-rank slices"), param_rows),
            text_table(("rank", "params", "grads", "optimizer", "total"), rank_rows),
        ]
    )


def run_demo(
    config: DemoConfig,
    out_dir: str | Path,
    pool: Any | None = None,
    ranks: int | None = None,
    backend: str | None = None,
    chunk: int = 5,
    out: TextIO | None = None,
) -> DemoResult:
    """Train ``config``'s model on a pool; write a checkpoint and ``out_dir/report.png``.

    The checkpoint goes to ``out_dir/checkpoints/step-NNNNNN`` (the newest three are kept).

    ``pool`` is used as given (and left running); without one, a pool of ``ranks`` ranks
    (default: one per visible GPU, else 2 CPU ranks) is started and stopped here, also on
    failure. Progress, the shard layout and a gradient-norm summary go to ``out``.
    """
    from fsdp_interactive.notebook.render import render_grad_norms
    from fsdp_interactive.pool import Pool

    out = out or sys.stdout
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    own_pool = pool is None
    if own_pool:
        print(f"Starting a pool of {ranks or 'default'} ranks ...", file=out, flush=True)
        pool = Pool(n=ranks, backend=backend).start()
    try:
        (param_count, *_) = pool.call(_rank_job.setup, config)
        result = DemoResult(world_size=pool.world_size, param_count=param_count)
        print(
            f"TinyTransformer: {param_count:,} parameters, FULL_SHARD over "
            f"{result.world_size} ranks, {config.steps} steps",
            file=out,
        )
        train_started = time.monotonic()
        while len(result.losses) < config.steps:
            steps = min(chunk, config.steps - len(result.losses))
            result.losses += pool.call(_rank_job.train, steps)[0]
            _progress(out, len(result.losses), config.steps, result.losses[-1], train_started)
        probes = pool.call(_rank_job.probe)
        result.layout = merge_layouts([layout for layout, _ in probes])
        result.grad_norms = probes[0][1]
        print("\n" + _layout_summary(result.layout), file=out)
        shallow = replace(result.grad_norms, modules=shallow_modules(result.grad_norms.modules))
        print("\n" + render_grad_norms(shallow, by="modules").text(), file=out)
        target = out_dir / "checkpoints" / f"step-{len(result.losses):06d}"
        saved = pool.call(_rank_job.save, str(target))[0]
        result.checkpoint, result.checkpoint_bytes = saved["path"], saved["bytes"]
        print(
            f"\ncheckpoint: {result.checkpoint} ({saved['bytes']:,} bytes, {saved['seconds']:.2f}s)",
            file=out,
        )
        pool.call(_rank_job.teardown)
    finally:
        if own_pool:
            pool.stop()
    result.report_png = str(write_report(result, out_dir / "report.png"))
    result.seconds = time.monotonic() - started
    print(f"report: {result.report_png}  ({result.seconds:.1f}s in all)", file=out)
    return result
