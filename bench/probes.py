"""Figure 4, the probes behind the views: their round trip at 30 to 3,000 parameters, 2 to 8 ranks.

On a pool started the notebook way (``%fsdp start -n N --devices cpu`` in a real IPython
shell), a model of ``P`` parameters is built on the ranks: ``P / 2`` layers
``nn.Linear(4, 4)`` in a row, wrapped by ``FullyShardedDataParallel`` (ours) with one
unit per layer, after one forward and backward so that gradients exist.  Each probe is
timed from the kernel, as the views call it (``RankModel``, which runs the probe on every
rank and pulls its plain-data answer):

* ``layout``: every rank's shard layout, merged in the kernel (no collective);
* ``grad norms``: per-parameter gradient norms (one small all-reduce);
* ``summon stats``: the full first parameter's statistics and histogram (all-gather);
* ``memory``: every rank's memory counters (no collective);
* ``%fsdp pull`` of a 64 MiB parameter (a separate ``nn.Linear(4096, 4096)``, sharded
  the same way; ``--force``): the full tensor gathered on the ranks and copied into the
  kernel.  It does not depend on ``P`` and is measured once per world size.

At real sizes, on 2 ranks: GPT-2 small built from its config with ``transformers`` (124M
parameters in 148 tensors, one unit per block, after one forward and backward), wrapped
two ways: by ``FullyShardedDataParallel`` (ours: DTensor parameters) and by torch's own
FSDP1 with flat parameters (``use_orig_params=False``, the probes reading each original
parameter from the flat parameters' bookkeeping); the same four probes, the summon
statistics of ``transformer.wte.weight`` (the 50257 x 768 token embedding, 38.6M
elements).  ``--quick`` keeps 1 of its 12 blocks (the embedding at full size) and runs the
forward without gradients (the grad norms then find none): the backward's reduce-scatter
of the embedding's gradient alone takes seconds on CPU ranks.  Without ``transformers``
(the ``hf`` extra) the cases are reported unavailable.  ``--gpt2`` runs these two cases
only.

The probes take turns, sample by sample.  Targets: each probe at most 250 ms at 300
parameters on 4 ranks, and growing no faster than linearly with the parameter count
(log-log slope at most 1 between 30 and 3,000 parameters); each probe of GPT-2 small at
most 1 s on 2 ranks, whichever wraps it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from bench.availability import missing
from bench.dispatch import ipython_shell, magic_pool, magic_unavailable, quiet_cell
from bench.growth import power_exponent
from bench.runner import (
    Comparison,
    Curve,
    FigureResult,
    Settings,
    Stat,
    Target,
    figure_main,
    rotated,
)

PROBE_LIMIT_S = 0.250
PULL = "%fsdp pull of a 64 MiB parameter"
PULL_CELL = "%fsdp pull big.weight --as pulled --force"
PROBES = ("layout", "grad norms", "summon stats", "memory")

_BUILD = """
import torch as _t
from torch import nn as _nn
from fsdp_interactive.fsdp import FullyShardedDataParallel as _FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as _Policy
_t.manual_seed(0)
model = _FSDP(
    _nn.Sequential(*[_nn.Linear(4, 4) for _ in range({layers})]),
    auto_wrap_policy=_Policy({{_nn.Linear}}),
    use_orig_params=True,
)
model(_t.randn(2, 4)).sum().backward()
del _t, _nn, _FSDP, _Policy
"""
GPT2_TENSOR = "transformer.wte.weight"
GPT2_CASE = "2 ranks, GPT-2 small"
GPT2_LIMIT_S = 1.0
#: How each GPT-2 case wraps the model (``{policy}``: the auto-wrap policy's name).
GPT2_WRAPPINGS = {
    "DTensor": (
        "from fsdp_interactive.fsdp import FullyShardedDataParallel as _FSDP\n",
        "_FSDP(_GPT2(_Config(n_layer={layers})), auto_wrap_policy=_Policy({{_Block}}), "
        "use_orig_params=True)",
    ),
    "torch FSDP1 (flat)": (
        "from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP\n",
        "_FSDP(_GPT2(_Config(n_layer={layers})), auto_wrap_policy=_Policy({{_Block}}), "
        "device_id=_t.device('cpu'), use_orig_params=False)",
    ),
}
_BUILD_GPT2 = """
import torch as _t
from transformers import GPT2Config as _Config, GPT2LMHeadModel as _GPT2
from transformers.models.gpt2.modeling_gpt2 import GPT2Block as _Block
{wrapper_import}from torch.distributed.fsdp.wrap import ModuleWrapPolicy as _Policy
_t.manual_seed(0)
gpt2 = {wrapped}
_tokens = _t.randint(0, gpt2.config.vocab_size, (2, 16))
if {backward}:
    gpt2(_tokens, labels=_tokens).loss.backward()
else:
    with _t.no_grad():
        gpt2(_tokens)
del _t, _Config, _GPT2, _Block, _FSDP, _Policy, _tokens
"""


def gpt2_build(wrapping: str, layers: int, backward: bool) -> str:
    """The cell that builds GPT-2 small as ``gpt2`` on the ranks, wrapped as ``wrapping``."""
    wrapper_import, wrapped = GPT2_WRAPPINGS[wrapping]
    return _BUILD_GPT2.format(
        wrapper_import=wrapper_import,
        wrapped=wrapped.format(layers=layers),
        backward=backward,
    )


_BUILD_BIG = """
import torch as _t
from fsdp_interactive.fsdp import FullyShardedDataParallel as _FSDP
big = _FSDP(_t.nn.Linear(4096, 4096, bias=False), use_orig_params=True)
del _t, _FSDP
"""


def _rotated_samples(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """``reps`` timed samples of each call after one untimed warm-up call each, the
    order rotated round by round so that no call always follows the same one."""
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(reps):
        for name in rotated(list(calls), index):
            samples[name].append(_timed(calls[name]))
    return samples


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _probe_calls(probe: Any, first_param: str) -> dict[str, Callable[[], Any]]:
    return {
        "layout": probe.layout,
        "grad norms": probe.grad_norms,
        "summon stats": lambda: probe.summon(first_param),
        "memory": probe.memory,
    }


def run(settings: Settings) -> FigureResult:
    """Probes: round trip of every view's probe against parameters and ranks."""
    result = FigureResult("probes", "Probes behind the views (round trip from the kernel)")
    unavailable = missing("fsdp_interactive.pool", "Pool") or magic_unavailable()
    if unavailable:
        raise RuntimeError(f"the probes figure needs the pool and the magics: {unavailable}")
    from fsdp_interactive.notebook.rank_model import RankModel

    worlds = (2,) if settings.quick else (2, 4, 8)
    sizes = (30, 300) if settings.quick else (30, 300, 3000)
    reps = 3 if settings.quick else 7
    pull_reps = 2 if settings.quick else 5
    result.notes.append(
        f"{reps} alternated samples per probe, size and world size after one warm-up call "
        f"each; {pull_reps} pulls per world size. Parameters: {', '.join(map(str, sizes))} "
        f"(that many tensors; {sizes[-1] // 2} layers at the largest). World sizes: "
        f"{', '.join(map(str, worlds))}."
    )
    per: dict[tuple[str, int], dict[int, Stat]] = {}
    pulls: dict[int, Stat] = {}
    for world in worlds:
        with ipython_shell() as shell, contextlib.ExitStack() as stack:
            pool = stack.enter_context(magic_pool(shell, world))
            for params in sizes:
                pool.run(_BUILD.format(layers=params // 2), stream=False, timeout=300)
                probe = RankModel(pool, "model")  # made once the model exists: it looks it up
                first = probe.layout().params[0].fqn
                samples = _rotated_samples(_probe_calls(probe, first), reps)
                for name, values in samples.items():
                    stat = Stat(values, "s")
                    per.setdefault((name, world), {})[params] = stat
                    result.measurements[f"{world} ranks, {params} parameters: {name}"] = stat
                pool.run("del model", stream=False)
            if world == 2:
                for wrapping in GPT2_WRAPPINGS:
                    result.comparisons += _gpt2_case(pool, settings.quick, reps, result, wrapping)
            pool.run(_BUILD_BIG, stream=False, timeout=300)
            quiet_cell(shell, PULL_CELL)
            pulls[world] = Stat(
                [_timed(lambda: quiet_cell(shell, PULL_CELL)) for _ in range(pull_reps)], "s"
            )
            shell.user_ns.pop("pulled", None)
            result.measurements[f"{world} ranks: {PULL}"] = pulls[world]
            pool.run("del big", stream=False)
    for (name, world), stats in per.items():
        result.curves.append(
            Curve(
                figure=result.key,
                panel=f"Probes at {world} ranks",
                name=name,
                x_label="parameters",
                xs=[float(p) for p in sorted(stats)],
                values=[stats[p] for p in sorted(stats)],
                per=1000.0,
            )
        )
    for name in PROBES:
        worlds_at_300 = [w for w in worlds if 300 in per.get((name, w), {})]
        if len(worlds_at_300) > 1:
            result.curves.append(
                Curve(
                    figure=result.key,
                    panel="Probes at 300 parameters",
                    name=name,
                    x_label="ranks",
                    xs=[float(w) for w in worlds_at_300],
                    values=[per[(name, w)][300] for w in worlds_at_300],
                )
            )
    result.curves.append(
        Curve(
            figure=result.key,
            panel="Probes at 300 parameters",
            name=PULL,
            x_label="ranks",
            xs=[float(w) for w in sorted(pulls)],
            values=[pulls[w] for w in sorted(pulls)],
        )
    )
    result.notes += _verdicts(per, pulls, worlds, sizes)
    result.comparisons += _budget_comparisons(result.key, per, worlds)
    return result


def _gpt2_case(
    pool: Any, quick: bool, reps: int, result: FigureResult, wrapping: str
) -> list[Comparison]:
    """The four probes on GPT-2 small at 2 ranks, wrapped as ``wrapping`` (``reps``
    alternated samples each after a warm-up call); adds measurements and a note, returns
    each probe against 1 s."""
    from fsdp_interactive.notebook.rank_model import RankModel

    case = f"{GPT2_CASE}, {wrapping}"
    unavailable = missing("transformers", "GPT2Config", "GPT2LMHeadModel")
    if unavailable:
        result.notes.append(f"{case}: {unavailable} (install the hf extra)")
        return [_within_a_second(result.key, case, name, None, unavailable) for name in PROBES]
    layers = 1 if quick else 12
    pool.run(gpt2_build(wrapping, layers, not quick), stream=False, timeout=600)
    try:
        probe = RankModel(pool, "gpt2", timeout=300)
        tensors = len(probe.layout().params)
        samples = _rotated_samples(_probe_calls(probe, GPT2_TENSOR), reps)
    finally:
        pool.run("del gpt2", stream=False)
    label = f"{case} ({layers} of 12 blocks, {tensors} tensors)"
    stats = {name: Stat(values, "s") for name, values in samples.items()}
    for name, stat in stats.items():
        what = f"summon stats of {GPT2_TENSOR}" if name == "summon stats" else name
        result.measurements[f"{label}: {what}"] = stat
    result.notes.append(
        f"{label}: summon statistics of {GPT2_TENSOR} (38.6M elements) "
        f"{stats['summon stats'].median * 1e3:.0f} ms median; layout "
        f"{stats['layout'].median * 1e3:.0f} ms, grad norms "
        f"{stats['grad norms'].median * 1e3:.0f} ms, memory "
        f"{stats['memory'].median * 1e3:.0f} ms (target <= {GPT2_LIMIT_S:g} s each)."
    )
    return [_within_a_second(result.key, case, name, stats[name]) for name in PROBES]


def _within_a_second(
    key: str, case: str, probe: str, measured: Stat | None, unavailable: str | None = None
) -> Comparison:
    """``probe`` on GPT-2 small against its 1 s budget (``None`` measured: unavailable)."""
    return Comparison(
        key,
        case,
        f"{probe} probe (ours)",
        "1 s budget",
        measured,
        Stat([GPT2_LIMIT_S], "s"),
        None if unavailable else Target("<=", 1.0),
        unavailable=unavailable,
    )


def run_gpt2(settings: Settings) -> FigureResult:
    """Probes on GPT-2 small at 2 ranks only, wrapped by ours (DTensor) and by torch FSDP1."""
    result = FigureResult("probes", "Probes behind the views (round trip from the kernel)")
    unavailable = missing("fsdp_interactive.pool", "Pool") or magic_unavailable()
    if unavailable:
        raise RuntimeError(f"the probes figure needs the pool and the magics: {unavailable}")
    reps = 3 if settings.quick else 7
    result.notes.append(f"{reps} alternated samples per probe after one warm-up call each.")
    with ipython_shell() as shell, magic_pool(shell, 2) as pool:
        for wrapping in GPT2_WRAPPINGS:
            result.comparisons += _gpt2_case(pool, settings.quick, reps, result, wrapping)
    return result


def _budget_comparisons(
    key: str, per: dict[tuple[str, int], dict[int, Stat]], worlds: tuple[int, ...]
) -> list[Comparison]:
    """Each probe at 300 parameters on 4 ranks (the largest world in quick mode) vs 250 ms."""
    world = 4 if 4 in worlds else worlds[-1]
    budget = Stat([PROBE_LIMIT_S], "s")
    return [
        Comparison(
            figure=key,
            case=f"{world} ranks, 300 parameters",
            subject_name=f"{name} probe (ours)",
            reference_name="250 ms budget",
            subject=per[(name, world)][300],
            reference=budget,
            target=Target("<=", 1.0),
        )
        for name in PROBES
        if 300 in per.get((name, world), {})
    ]


def _verdicts(
    per: dict[tuple[str, int], dict[int, Stat]],
    pulls: dict[int, Stat],
    worlds: tuple[int, ...],
    sizes: tuple[int, ...],
) -> list[str]:
    """One sentence per probe: the 250 ms target at 300 parameters, 4 ranks, and growth."""
    world = 4 if 4 in worlds else worlds[-1]
    lines = []
    for name in PROBES:
        stats = per[(name, world)]
        at_300 = stats.get(300)
        exponents = [
            power_exponent(
                [float(p) for p in sorted(per[(name, w)])],
                [per[(name, w)][p].median for p in sorted(per[(name, w)])],
            )
            for w in worlds
        ]
        worst = max((e for e in exponents if e is not None), default=None)
        budget = Comparison(
            "probes", "", name, "budget", at_300, Stat([PROBE_LIMIT_S], "s"), Target("<=", 1.0)
        )
        outcome = {"missed": "**missed**"}.get(budget.verdict or "", budget.verdict)
        growth_ok = worst is not None and worst <= 1.0
        lines.append(
            f"{name}: {at_300.median * 1e3:.0f} ms at 300 parameters on {world} ranks "
            f"(target <= {PROBE_LIMIT_S * 1e3:.0f} ms: {outcome}); "
            f"log-log slope over {sizes[0]}-{sizes[-1]} parameters at most "
            f"{worst:.2f} over {', '.join(map(str, worlds))} ranks (target <= 1, no faster "
            f"than linear: {'met' if growth_ok else '**missed**'})."
            if at_300 is not None and worst is not None
            else f"{name}: not enough points for a verdict."
        )
    if world in pulls:
        lines.append(
            f"{PULL}: {pulls[world].median * 1e3:.0f} ms on {world} ranks "
            f"({64 / pulls[world].median:.0f} MiB/s; no target)."
        )
    return lines


if __name__ == "__main__":
    import sys

    arguments = sys.argv[1:]
    only_gpt2 = "--gpt2" in arguments
    arguments = [a for a in arguments if a != "--gpt2"]
    raise SystemExit(figure_main(run_gpt2 if only_gpt2 else run, arguments))
