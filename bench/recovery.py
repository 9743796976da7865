"""Figure: recovery: from a SIGKILL of one rank to training again at the saved state.

GPT-2 small built from its config (``GPT2Config()``: 124M parameters), wrapped per
``GPT2Block`` with ``fsdp_interactive.fsdp.FullyShardedDataParallel``, AdamW, on CPU ranks
(gloo). Each sample is timed from the SIGKILL of rank 1 to the end of the first training
step at the saved state (one sequence of 32 tokens per rank). Contenders, alternated round
by round (the order rotated), each on fresh processes (starting them is not timed):

* ``Pool.recover()`` (ours): a ``Pool(N)`` runs the cells of a user's notebook, none
  marked for the recovery: the build cell (GPT-2, AdamW, the training step as a function),
  a training cell (one step), a disk checkpoint (``checkpoint.save(root + "/step-1", ...)``),
  its load, then a cell that takes ``fsdp_interactive.snapshot(model=, optimizer=)``;
  rank 1 (its pid from ``pool.topology``) is killed; the next ``pool.run`` of a training
  step raises ``RankDied`` (detection is timed), then ``pool.recover()`` (a fresh group, the
  slice replayed: the build cell alone, its parameter initialization skipped; the snapshot
  restored from host memory) and one training step;
* torchrun ``--max-restarts 1`` (the reference): ``bench/scripts/recovery_rank.py`` builds
  the model, takes one step, saves a disk checkpoint with ``fsdp_interactive.checkpoint.save``
  and rank 1 kills itself (printing the time); the launcher restarts every worker, which
  build the model, ``checkpoint.load`` the newest checkpoint and take one step (rank 0
  prints the time);
* ``Pool.restart()`` by hand (what a user does without recovery): the same pool cells with
  a disk checkpoint instead of a snapshot; after the kill and ``RankDied``, ``restart()``
  (a fresh, empty group), the setup cell run again, ``checkpoint.load``, one step.

Every contender rebuilds the model and loads without running the step that preceded the
save again, so the three do the same work after the kill.

Also reported: the time from the kill to a trained step, the cells ours replayed and its
replay phase against the build cell's own time when it first ran (target <= 1x), the
parameter initializations the replay skipped, the bytes one snapshot holds per host (the
snapshot record's ``bytes_per_host``) and the restore's rate from them (target >= 2 GB/s
per host), and, unless ``--cost-steps 0``, the training rate
with a background snapshot every 10 steps against none (a loop of 20 steps with snapshots
after steps 5 and 15, so that every background write overlaps later steps; the last write
is awaited inside the timing). Target: ours <= 0.5x torchrun's time from the kill to the
state restored. Each round records the host's load average before it.

    .venv/bin/python -m bench.recovery [--ranks 2 [4]] [--samples 3] [--cost-steps 20]
                                       [--json FILE] [--tiny]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.formatting import fmt_ratio, fmt_stat, verdict
from bench.run_info import now_and_load
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, rotated
from bench.torchrun import launch, stop_session

RECOVERY_SCRIPT = Path(__file__).resolve().parent / "scripts" / "recovery_rank.py"

OURS = "Pool.recover() from a snapshot (ours)"
TORCHRUN = "torchrun --max-restarts 1 from a disk checkpoint"
RESTART = "Pool.restart() + setup cell + checkpoint.load by hand"
TARGET = Target("<=", 0.5)
#: The replay phase against the build cell's first run.
REPLAY = "ours: the replay phase (the build cell, initialization skipped)"
BUILD = "the build cell when it first ran"
REPLAY_TARGET = Target("<=", 1.0)
#: The restore phase's rate: the snapshot's bytes on its largest host over its seconds.
RESTORE_RATE = "ours: the restore from host memory, GB per second per host"
RATE_TARGET_GB_S = 2.0
RATE_REFERENCE = f"{RATE_TARGET_GB_S:g} GB/s per host"
RATE_TARGET = Target(">=", 1.0)
#: A GPT-2 small enough for a smoke test (``--tiny``): the same code paths in seconds.
TINY_CONFIG: dict[str, int] = {
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "vocab_size": 128,
    "n_positions": 64,
}

_SETUP = """
import torch
import fsdp_interactive
from fsdp_interactive import checkpoint
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
torch.manual_seed(0)
config = GPT2Config(**{config!r})
model = FSDP(GPT2LMHeadModel(config), auto_wrap_policy=ModuleWrapPolicy({{GPT2Block}}))
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

def train_step(step):
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, config.vocab_size, (1, 32), generator=generator)
    model(tokens, labels=tokens).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)

def probed_step(step):
    # train_step(step), and what it cost this process: wall and CPU seconds, the part of
    # those spent in the kernel (page faults, gloo's sockets), minor page faults, and the
    # times it was taken off a core (involuntary context switches).
    import resource, time
    wall, cpu, before = time.perf_counter(), time.process_time(), resource.getrusage(0)
    train_step(step)
    after = resource.getrusage(0)
    return dict(
        wall=time.perf_counter() - wall,
        cpu=time.process_time() - cpu,
        kernel=after.ru_stime - before.ru_stime,
        page_faults=after.ru_minflt - before.ru_minflt,
        preempted=after.ru_nivcsw - before.ru_nivcsw,
    )

def timed_steps(first, count, every):
    import time
    handle = None
    dist.barrier()
    began = time.perf_counter()
    for step in range(first, first + count):
        train_step(step)
        if every and (step + 1) % every == every // 2:
            handle = fsdp_interactive.snapshot(
                model=model, optimizer=optim, step=step + 1, background=True
            )
    if handle is not None:
        handle.wait()
    dist.barrier()
    return time.perf_counter() - began
"""
_SNAPSHOT = "fsdp_interactive.snapshot(model=model, optimizer=optim, step=1)"
#: The disk checkpoint of the user's notebook (ours): saved, then loaded, before the snapshot.
_ROOT = "root = {folder!r}\n"
_SAVE_AT_ROOT = 'checkpoint.save(root + "/step-1", model, optim, step=1)'
_LOAD_AT_ROOT = 'checkpoint.load(root + "/step-1", model, optim)'

_SAVE = "import fsdp_interactive.checkpoint\nfsdp_interactive.checkpoint.save({path!r}, model, optim, step=1)"
_LOAD = (
    "import fsdp_interactive.checkpoint\nfsdp_interactive.checkpoint.load({path!r}, model, optim)"
)
_FIRST_STEP = "train_step(0)"
_STEP = "train_step(1)"
#: The first step after the state is back, probed on every rank (``probed_step``).
_PROBED_STEP = "first_step_cost = probed_step(1)"
#: The step after it, probed the same way: whether a slower first step is a first-step cost.
_PROBED_NEXT_STEP = "next_step_cost = probed_step(2)"


def _step_cost(pool: Any, name: str = "first_step_cost", prefix: str = "step") -> dict[str, float]:
    """What a probed step (its costs in the ranks' variable ``name``) cost: the slowest
    rank's wall, CPU and kernel seconds, page faults and preemptions (``{prefix}_wall``,
    ``{prefix}_cpu``, ``{prefix}_kernel``, ``{prefix}_page_faults``,
    ``{prefix}_preempted``)."""
    costs = pool.pull(name)
    return {f"{prefix}_{key}": float(max(c[key] for c in costs)) for key in costs[0]}


def _next_step_cost(pool: Any, cell: int) -> dict[str, float]:
    """Take and probe the step after the first (untimed by the sample's total)."""
    pool.run(_PROBED_NEXT_STEP, cell=cell, stream=False)
    return _step_cost(pool, "next_step_cost", "next_step")


def setup_cell(config: Mapping[str, int]) -> str:
    """The pool's setup cell: GPT-2 from ``GPT2Config(**config)``, AdamW, the training
    step as a function (the first step is a cell of its own)."""
    return _SETUP.format(config=dict(config))


def _pool(world: int) -> Any:
    from fsdp_interactive.pool import Pool

    return Pool(world, devices="cpu", show_topology=False)


def _kill_rank_1(pool: Any) -> float:
    """SIGKILL rank 1 by its pid; the moment of the kill (``perf_counter``)."""
    pid = next(r.pid for r in pool.topology if r.rank == 1)
    began = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    return began


def _detect(pool: Any, cell: int) -> None:
    """Run a training step; the pool must answer with ``RankDied`` (rank 1 is dead)."""
    from fsdp_interactive.pool import RankDied

    try:
        pool.run(_STEP, cell=cell, stream=False, replay=False)
    except RankDied:
        return
    raise RuntimeError("a training step ran although rank 1 was killed: no RankDied")


def ours_sample(world: int, config: Mapping[str, int], folder: str) -> dict[str, float]:
    """One recovery with ``Pool.recover()``: seconds from the kill, in phases.

    Keys: ``total``, ``detect`` (to ``RankDied``), the recovery's own phases (``end``,
    ``start``, ``find``, ``replay``, ``restore``), ``step`` (the first step after it; its
    probe's ``step_*`` and the next step's ``next_step_*``),
    ``build`` (the build cell's own time when it first ran), ``skipped_inits`` (rank 0's
    parameter initializations the replay skipped), ``restore_check`` / ``restore_load``
    (rank 0's restore: checking every host's copy, then loading), ``prechecked_files``
    (copies whose checksum the hosts' engine forkers took during the recovery),
    ``bytes_per_host`` (the largest host's bytes of the snapshot). Raises unless the
    recovery replayed the build cell alone.
    """
    pool = _pool(world)
    try:
        pool.start()
        # The notebook of a user who marks nothing for the recovery.
        pool.run(setup_cell(config) + _ROOT.format(folder=folder), cell=1, stream=False)
        pool.run(_FIRST_STEP, cell=2, stream=False)
        pool.run(_SAVE_AT_ROOT, cell=3, stream=False)
        pool.run(_LOAD_AT_ROOT, cell=4, stream=False)
        pool.run(_SNAPSHOT, cell=5, stream=False)
        build = pool.journal.entries[0]
        held = pool.snapshots()[-1].bytes_per_host
        began = _kill_rank_1(pool)
        _detect(pool, cell=6)
        detected = time.perf_counter()
        # recover() prints its progress and report; the phases are kept from the report.
        with contextlib.redirect_stdout(io.StringIO()):
            report = pool.recover()
        recovered = time.perf_counter()
        pool.run(_PROBED_STEP, cell=7, stream=False)
        done = time.perf_counter()
        step_cost = {**_step_cost(pool), **_next_step_cost(pool, cell=8)}
    finally:
        pool.stop()
    replayed = [entry.label for entry in report.replayed]
    if replayed != [build.label]:
        raise RuntimeError(f"the recovery replayed {replayed}, not the build cell alone")
    phases = {name: float(seconds) for name, seconds in report.phases.items()}
    restored = report.restored  # rank 0's RestoreReport, as a dict
    outcome = report.replay_outcome
    return {
        "total": done - began,
        "ready": recovered - began,
        "detect": detected - began,
        **phases,
        "recover": recovered - detected,
        "step": done - recovered,
        **step_cost,
        "build": float(build.seconds or 0.0),
        "skipped_inits": float(outcome.skipped_inits if outcome else 0),
        "restore_check": float(restored["phases"]["verify"]),
        "restore_load": float(restored["phases"]["load"]),
        "prechecked_files": float(restored["prechecked_files"]),
        "bytes_per_host": float(max(held.values())),
    }


def restart_sample(world: int, config: Mapping[str, int], folder: str) -> dict[str, float]:
    """One manual restart: ``RankDied``, ``Pool.restart()``, the setup cell again,
    ``checkpoint.load`` from a disk checkpoint saved in ``folder``, one step (probed, as the
    step after it, as in :func:`ours_sample`)."""
    pool = _pool(world)
    setup = setup_cell(config)
    path = os.path.join(folder, "step-1")
    try:
        pool.start()
        pool.run(setup, cell=1, stream=False)
        pool.run(_FIRST_STEP, cell=2, stream=False)
        pool.run(_SAVE.format(path=path), cell=3, stream=False)
        began = _kill_rank_1(pool)
        _detect(pool, cell=4)
        detected = time.perf_counter()
        pool.restart()
        restarted = time.perf_counter()
        pool.run(setup, cell=5, stream=False)
        rebuilt = time.perf_counter()
        pool.run(_LOAD.format(path=path), cell=6, stream=False)
        loaded = time.perf_counter()
        pool.run(_PROBED_STEP, cell=7, stream=False)
        done = time.perf_counter()
        step_cost = {**_step_cost(pool), **_next_step_cost(pool, cell=8)}
    finally:
        pool.stop()
    return {
        "total": done - began,
        "ready": loaded - began,
        "detect": detected - began,
        "restart": restarted - detected,
        "setup": rebuilt - restarted,
        "load": loaded - rebuilt,
        "step": done - loaded,
        **step_cost,
    }


def torchrun_sample(
    world: int, config: Mapping[str, int], folder: str, timeout: float = 900.0
) -> dict[str, float]:
    """One torchrun restart of ``bench/scripts/recovery_rank.py``: seconds from rank 1's
    self-kill to rank 0's first step after the relaunch (both printed as unix times)."""
    with tempfile.TemporaryFile("w+") as errors:
        proc = launch(
            world,
            RECOVERY_SCRIPT,
            stderr=errors,
            torchrun_args=("--max-restarts=1",),
            extra_env={
                "BENCH_CHECKPOINT_DIR": folder,
                "BENCH_GPT2_CONFIG": json.dumps(dict(config)),
            },
        )
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_session(proc)
            raise TimeoutError(
                f"torchrun of {RECOVERY_SCRIPT.name} overran {timeout:.0f}s"
            ) from None
        finally:
            stop_session(proc)
        errors.seek(0)
        tail = errors.read()[-3000:]
    times = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("KILLED", "LOADED", "STEPPED"):
            times[parts[0]] = float(parts[1])
    if proc.returncode != 0 or set(times) != {"KILLED", "LOADED", "STEPPED"}:
        raise RuntimeError(
            f"torchrun of {RECOVERY_SCRIPT.name} exited with {proc.returncode}, "
            f"printed {sorted(times)}:\n{stdout[-1000:]}\n{tail}"
        )
    return {
        "total": times["STEPPED"] - times["KILLED"],
        "ready": times["LOADED"] - times["KILLED"],
    }


def snapshot_cost(
    world: int, config: Mapping[str, int], steps: int, every: int, samples: int
) -> dict[str, list[float]]:
    """Seconds of ``steps`` training steps on one pool, without snapshots and with a
    background snapshot every ``every`` steps, alternated; rank 0's times."""
    pool = _pool(world)
    runs: dict[str, list[float]] = {"none": [], "background": []}
    try:
        pool.start()
        pool.run(setup_cell(config), cell=1, stream=False)
        first = 1
        for index in range(samples):
            for name in rotated(list(runs), index):
                cadence = every if name == "background" else 0
                code = f"timed_steps({first}, {steps}, {cadence})"
                result = pool.run(code, stream=False, replay=False)
                runs[name].append(float(ast.literal_eval(result.results[0])))
                first += steps
    finally:
        pool.stop()
    return runs


def measure(
    worlds: Sequence[int],
    samples: int,
    config: Mapping[str, int],
    cost_steps: int = 20,
    cost_every: int = 10,
    log: Callable[[str], None] = lambda line: None,
) -> FigureResult:
    """The figure at each world size in ``worlds``; ``samples`` rounds of the three
    contenders, alternated; then the snapshot cost (skipped when ``cost_steps`` is 0)."""
    result = FigureResult("recovery", "Recovery after a SIGKILL")
    model = "GPT-2 small (GPT2Config())" if not config else f"GPT2Config(**{dict(config)})"
    result.notes.append(
        f"{model} + AdamW; {samples} sample(s) per contender and world size, the three "
        "rotated round by round, no warm-up round; each sample on fresh processes "
        "(their start untimed). CPU ranks, gloo; intra-op threads: the pool's ranks share "
        "the host's cores (cores // ranks, at least 1), torchrun's have OMP_NUM_THREADS=1."
    )
    for world in worlds:
        case = f"{world} ranks"
        totals: dict[str, list[float]] = {OURS: [], TORCHRUN: [], RESTART: []}
        readies: dict[str, list[float]] = {name: [] for name in totals}
        parts: dict[str, list[float]] = {}
        loads: list[float] = []
        for index in range(samples):
            loads.append(os.getloadavg()[0])
            for name in rotated(list(totals), index):
                folder = tempfile.mkdtemp(prefix="fsdpi-bench-recovery-")
                try:
                    if name == OURS:
                        sample = ours_sample(world, config, folder)
                    elif name == TORCHRUN:
                        sample = torchrun_sample(world, config, folder)
                    else:
                        sample = restart_sample(world, config, folder)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
                totals[name].append(sample.pop("total"))
                readies[name].append(sample.pop("ready"))
                label = "ours" if name == OURS else "by hand" if name == RESTART else ""
                for part, value in sample.items():
                    parts.setdefault(f"{case}: {label}: {part}", []).append(value)
                log(
                    f"{case}, round {index + 1} (load {loads[-1]:.2f}): {name}: "
                    f"{totals[name][-1]:.2f} s"
                )
        result.measurements[f"{case}: load average (1 min) before each round"] = Stat(loads, "")
        stats = {name: Stat(values, "s") for name, values in totals.items()}
        ready = {name: Stat(values, "s") for name, values in readies.items()}
        for name, stat in stats.items():
            result.measurements[f"{case}: kill to a trained step, {name}"] = stat
            result.measurements[f"{case}: kill to the state restored, {name}"] = ready[name]
        for part, values in parts.items():
            unit = (
                "B"
                if part.endswith("bytes_per_host")
                else ""
                if any(word in part for word in ("inits", "faults", "preempted", "files"))
                else "s"
            )
            name = f"{case}: one snapshot in host memory, per host" if unit == "B" else part
            result.measurements[name] = Stat(values, unit)
        # The last row leaves out the first step after the restore, which is the same
        # work for all three and, on CPU ranks, as long as the rest together.
        restored = f"{case}, kill to the state restored (before the first step)"
        trained = f"{case}, kill to a trained step"
        build = {
            REPLAY: Stat(parts[f"{case}: ours: replay"], "s"),
            BUILD: Stat(parts[f"{case}: ours: build"], "s"),
        }
        held = parts[f"{case}: ours: bytes_per_host"]
        rate = Stat(
            [b / t / 1e9 for b, t in zip(held, parts[f"{case}: ours: restore"], strict=True)],
            "GB/s",
        )
        result.measurements[f"{case}: {RESTORE_RATE}"] = rate
        rates = {RESTORE_RATE: rate, RATE_REFERENCE: Stat([RATE_TARGET_GB_S], "GB/s")}
        for row_case, times, subject, reference, target, note in (
            (restored, ready, OURS, TORCHRUN, TARGET, ""),
            (trained, stats, OURS, TORCHRUN, None, "no target: the first step included"),
            (
                trained,
                stats,
                RESTART,
                TORCHRUN,
                None,
                "no target: what a user does today, beside torchrun",
            ),
            (trained, stats, OURS, RESTART, None, "no target: ours beside the manual restart"),
            (f"{case}, the build cell", build, REPLAY, BUILD, REPLAY_TARGET, ""),
            (f"{case}, the restore", rates, RESTORE_RATE, RATE_REFERENCE, RATE_TARGET, ""),
        ):
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case=row_case,
                    subject_name=subject,
                    reference_name=reference,
                    subject=times[subject],
                    reference=times[reference],
                    target=target,
                    note=note,
                    paired=True,
                )
            )
        if cost_steps:
            runs = snapshot_cost(world, config, cost_steps, cost_every, samples)
            rate = {k: Stat([cost_steps / s for s in v], "steps/s") for k, v in runs.items()}
            plain = f"{case}: steps/s without snapshots"
            every = f"{case}: steps/s with a background snapshot every {cost_every} steps"
            result.measurements[plain] = rate["none"]
            result.measurements[every] = rate["background"]
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case=case,
                    subject_name=f"steps/s, a background snapshot every {cost_every} steps",
                    reference_name="steps/s without snapshots",
                    subject=rate["background"],
                    reference=rate["none"],
                    target=None,
                    note=f"no target: the rate kept, {cost_steps}-step loops alternated",
                    paired=True,
                )
            )
            log(f"{case}: snapshot cost measured")
    return result


def run(settings: Settings) -> FigureResult:
    """Recovery: Pool.recover() vs torchrun --max-restarts 1 vs a manual restart."""
    if settings.quick:
        return measure((2,), 1, TINY_CONFIG, cost_steps=4, cost_every=2)
    return measure((2,), settings.samples or 3, {})


def markdown(result: FigureResult) -> str:
    """The figure as Markdown: the comparisons, then every measurement."""
    lines = [
        "| Case | Subject | Reference | Ratio | Target | Result |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in result.comparisons:
        note = f" ({c.note})" if c.note else ""
        lines.append(
            f"| {c.case}{note} | {c.subject_name}: {fmt_stat(c.subject)} | "
            f"{c.reference_name}: {fmt_stat(c.reference)} | {fmt_ratio(c)} | "
            f"{c.target or 'n/a'} | {verdict(c)} |"
        )
    lines += ["", "| Measurement | Median [min to max] | Samples |", "| --- | --- | --- |"]
    for name, stat in result.measurements.items():
        lines.append(f"| {name} | {fmt_stat(stat)} | {len(stat.samples)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes")
    parser.add_argument("--samples", type=int, default=3, help="rounds per world size")
    parser.add_argument(
        "--cost-steps",
        type=int,
        default=20,
        help="steps per loop of the snapshot-cost measurement (0: skip it)",
    )
    parser.add_argument("--cost-every", type=int, default=10, help="steps between snapshots")
    parser.add_argument("--json", type=Path, help="also write the figure's records here")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT-2 (smoke test)")
    args = parser.parse_args(argv)
    if args.samples < 1 or any(world < 2 for world in args.ranks):
        parser.error("--samples must be >= 1 and every --ranks >= 2 (rank 1 is killed)")
    began = now_and_load()
    started = time.perf_counter()
    result = measure(
        args.ranks,
        args.samples,
        TINY_CONFIG if args.tiny else {},
        cost_steps=args.cost_steps,
        cost_every=args.cost_every,
        log=lambda line: print(f"[recovery] {line}", file=sys.stderr, flush=True),
    )
    result.seconds = time.perf_counter() - started
    result.measured = f"from {began} to {now_and_load()}"
    print(f"Measured {result.measured}.")
    for note in result.notes:
        print(note)
    print()
    print(markdown(result))
    for c in result.comparisons:
        if c.target is not None:
            # "met"/"missed" at the median, and the report's verdict, which also weighs
            # the noise (unresolved when the ratio's interval straddles the target).
            at_median = "met" if c.ratio is not None and c.target.met(c.ratio) else "missed"
            print(
                f"\n{c.case}: {c.subject_name} / {c.reference_name} = {c.ratio:.3f} "
                f"(target {c.target}): {at_median} at the median; by the 95% interval: "
                f"{verdict(c)}"
            )
    if args.json:
        args.json.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
