"""``RankModel``: run the inspect probes on a model that lives on the pool's ranks.

The model, optimizer and recorder are named by Python expressions evaluated in the
ranks' namespace (``"model"``, ``"trainer.model"``).  Each probe is one ``pool.run`` of a
code string that stores the probe's plain-data answer in a scratch variable, followed by
one ``pool.pull`` of it; the scratch variable is deleted again.  Nothing is gathered to the
kernel except the probes' small records.

The caller's input is checked as early as it can be: the model and optimizer a
``RankModel`` is given are looked up on rank 0 when it is made (``RankModel(pool,
"modle")`` fails at once, naming the ranks' models that come close), its recorder when
first used, and a probe that fails on the caller's
input (a parameter name the model does not have) raises a short
:class:`._probe_input.ProbeInputError` in the kernel instead of the ranks' traceback.
"""

from __future__ import annotations

import ast
import math
from typing import Any

from fsdp_interactive._text import did_you_mean
from fsdp_interactive.inspect import (
    PROBES,
    GradNormRecord,
    GradNorms,
    MemoryStats,
    ModelLayout,
    TensorStats,
)
from fsdp_interactive.notebook._probe_input import ProbeInputError, input_error, norm_type_literal

_SCRATCH = "_fsdp_interactive_probe"


def _literal(value: Any, call: str) -> str:
    """``value`` as Python source the ranks evaluate to an equal value (``float('inf')``
    for a non-finite float); :class:`ProbeInputError` naming ``call`` for a value that has
    no such source (an object of the kernel's)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    source = repr(value)
    try:
        same = ast.literal_eval(source) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        same = False
    if not same:
        raise ProbeInputError(
            f"{call}: {source} is not a plain value (a number, string, bool, None, or a "
            "tuple, list or dict of them) that can be sent to the ranks"
        )
    return source


def _check_expression(argument: str, value: str | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"{argument} must name a variable on the ranks, e.g. 'model'; got {value!r}"
        )
    try:
        compile(value, f"<{argument}>", "eval")
    except SyntaxError:
        raise ValueError(
            f"{argument}={value!r} is not a Python expression; give the name of the variable on "
            "the ranks, e.g. 'model' or 'trainer.model'"
        ) from None


class RankModel:
    """Probe a model on the pool's ranks; every method is a plain call that widgets reuse.

    ``model``, ``optimizer`` and ``recorder`` are expressions evaluated on the ranks
    (``model`` defaults to ``"model"``); a model and an optimizer given are looked up on
    rank 0 at once (the recorder when first used), and one the ranks do not have, or that
    holds the wrong kind of value, raises :class:`ProbeInputError` naming the close
    matches.  Probes that are collectives (grad
    norms, summon, edit) run on every rank; layout and memory also run on every rank and
    are merged here.  An argument a probe cannot take (a parameter name the model does not
    have) raises :class:`ProbeInputError` (``UnknownNameError``, also a ``KeyError``, for a
    name); other errors on the ranks propagate as the pool's ``RankError``. The model may be wrapped in any way
    :mod:`fsdp_interactive.wrapping` understands (torch FSDP1, DDP, ``torch.compile``, ...):
    the probes name parameters by their clean FQNs and accept the wrapped names too.
    """

    def __init__(
        self,
        pool: Any,
        model: str | None = None,
        optimizer: str | None = None,
        recorder: str | None = None,
        timeout: float | None = 120.0,
    ):
        _check_expression("model", model, optional=True)
        _check_expression("optimizer", optimizer, optional=True)
        _check_expression("recorder", recorder, optional=True)
        self.pool = pool
        self.model = "model" if model is None else model
        self.optimizer = optimizer
        self.recorder = recorder
        self.timeout = timeout
        # The recorder is looked up when first used: training code often makes it later.
        given = {"model": (model, "module"), "optimizer": (optimizer, "optimizer")}
        self._check_sources({k: v for k, v in given.items() if v[0] is not None})
        self._recorder_checked = False

    def _check_sources(self, sources: dict[str, tuple[str, str]]) -> None:
        """Look the given variables up on rank 0; :class:`ProbeInputError` for the first
        that the ranks lack or that holds the wrong kind of value."""
        if not sources:
            return
        problems = self.evaluate(
            f"_fsdp_interactive_inspect.check_sources(globals(), {sources!r})", targets=[0]
        )[0]
        if problems:
            argument, problem = next(iter(problems.items()))
            raise ProbeInputError(
                f"RankModel(pool, {argument}={sources[argument][0]!r}): {problem}"
            )

    def evaluate(
        self, expression: str, targets: list[int] | None = None, *, call: str | None = None
    ) -> list[Any]:
        """Evaluate ``expression`` on the ranks; the per-rank values, in rank order.

        ``_fsdp_interactive_inspect`` and ``_fsdp_interactive_checkpoint`` (the inspect and
        checkpoint packages) are importable names inside ``expression``.  The values must
        be picklable plain data.  When every rank fails on the caller's input (a probe's
        :class:`fsdp_interactive.inspect.ProbeInputError`, a name the model does not have),
        :class:`ProbeInputError` is raised here, its message after ``call`` (how the caller
        wrote the call).
        """
        code = (
            "import fsdp_interactive.inspect as _fsdp_interactive_inspect\n"
            "import fsdp_interactive.checkpoint as _fsdp_interactive_checkpoint\n"
            f"{_SCRATCH} = {expression}\n"
        )
        from fsdp_interactive.pool import RankError

        try:
            self.pool.run(code, targets=targets, timeout=self.timeout, stream=False, journal=False)
        except RankError as error:
            short = input_error(error, call)
            if short is None:
                raise
            raise short from None
        try:
            return list(self.pool.pull(_SCRATCH, targets=targets))
        finally:
            self.pool.run(
                f"del {_SCRATCH}, _fsdp_interactive_inspect, _fsdp_interactive_checkpoint",
                targets=targets,
                stream=False,
                journal=False,
            )

    def _probe(self, expression: str, targets: list[int] | None = None, call: str = "") -> Any:
        return self.evaluate(expression, targets, call=call or None)

    def ask(self, probe: str, *arguments: Any, **keywords: Any) -> Any:
        """The answer of the probe named ``probe`` (a name of
        :data:`fsdp_interactive.inspect.PROBES`), run on every rank with this model first
        (for a probe of the model) and then ``arguments`` and ``keywords``, plain values
        sent as Python literals; the ranks' answers combined as the probe declares (the
        same record from every rank, one per rank, or merged). An unknown name, or an
        argument that is no plain value, raises :class:`ProbeInputError`."""
        shown = ", ".join([repr(probe), *map(repr, arguments)])
        shown += "".join(f", {k}={v!r}" for k, v in keywords.items())
        call = f"RankModel.ask({shown})"
        if probe not in PROBES:
            raise ProbeInputError(
                f"{call}: no probe {probe!r}; "
                + (did_you_mean(probe, PROBES) or f"the probes are {', '.join(PROBES)}")
            )
        sources = [_literal(a, call) for a in arguments]
        sources += [f"{k}={_literal(v, call)}" for k, v in keywords.items()]
        return self._ask(probe, ", ".join(sources), call)

    def _ask(self, probe: str, arguments: str = "", call: str = "") -> Any:
        """The probe ``probe`` run on every rank with ``arguments`` (Python source, after
        the model for a probe of the model) and its answers combined as declared."""
        declared = PROBES[probe]
        given = [self.model] if declared.on_model else []
        given += [arguments] if arguments else []
        answers = self._probe(f"_fsdp_interactive_inspect.{probe}({', '.join(given)})", call=call)
        return declared.combine(answers)

    def layout(self) -> ModelLayout:
        """The model's shard layout (:class:`~fsdp_interactive.inspect.ModelLayout`): units,
        parameters, which rank holds which slice, and the bytes each rank holds."""
        optimizer = self.optimizer or "None"
        # Every rank describes the same parameters: only rank 0 sends them (a model with
        # thousands of parameters would otherwise send and unpickle them once per rank).
        return self._ask("layout", f"{optimizer}, params_from_rank=0")

    def grad_norms(self, norm_type: float = 2.0) -> GradNorms:
        """Gradient norms of ``norm_type`` (2.0, 1.0, ``float('inf')``, ...) per parameter and
        module and in total, as the framework's own ``clip_grad_norm_`` computes them; before
        the first backward the record says "no gradients yet"."""
        literal = norm_type_literal(norm_type, f"RankModel.grad_norms({norm_type!r})")
        return self._ask("grad_norms", literal)

    def summon(self, fqn: str, bins: int = 40) -> TensorStats:
        """Statistics of the full parameter ``fqn`` (clean or wrapped name) and a histogram of
        ``bins`` bins, computed where the shards are: no parameter is gathered."""
        return self._ask(
            "summon_stats", f"{fqn!r}, bins={int(bins)}", call=f"RankModel.summon({fqn!r})"
        )

    def edit(self, fqn: str, expression: str, bins: int = 40) -> TensorStats:
        """Set the full parameter ``fqn`` to ``expression`` (Python evaluated on every rank, ``p``
        being the full parameter) and return its new statistics; only the units that own it are
        gathered. The journal notes the change (an export cannot do it again)."""
        stats = self._ask(
            "edit_param",
            f"{fqn!r}, {expression!r}, bins={int(bins)}",
            call=f"RankModel.edit({fqn!r}, {expression!r})",
        )
        self.pool.journal.note_outside(f"{self.model}: {fqn} edited to {expression}")
        return stats

    def clean_name(self, name: str) -> str | None:
        """The clean FQN of the parameter or module called ``name`` (clean, or wrapped as the
        model on the ranks names it: ``module.``, ``_fsdp_wrapped_module.``, ``_orig_mod.``);
        ``None`` when there is none. Asks rank 0 only (no collective)."""
        return self._probe(
            f"_fsdp_interactive_inspect.clean_name({self.model}, {name!r})", targets=[0]
        )[0]

    def memory(self) -> list[MemoryStats]:
        """Every rank's memory (process, parameters, gradients, optimizer state, CUDA where there
        is one), in rank order."""
        return self._ask("memory")

    def history(self, since: int = 0) -> list[GradNormRecord]:
        """The steps the recorder named at construction has recorded since step ``since``; without
        a recorder, ``ValueError``."""
        if self.recorder is None:
            raise ValueError(
                "no recorder: create RankModel(pool, recorder='recorder') naming a "
                "GradNormRecorder that lives on the ranks"
            )
        if not self._recorder_checked:
            self._check_sources({"recorder": (self.recorder, "recorder")})
            self._recorder_checked = True
        return self._probe(f"{self.recorder}.history(since={int(since)})")[0]

    def topology(self) -> list[Any]:
        """The pool's ranks: rank, host, pid, device (one record per rank)."""
        return list(self.pool.topology)

    def names(self) -> tuple[list[str], list[str]]:
        """(parameter FQNs, module FQNs that own parameters), from the layout."""
        params = [p.fqn for p in self.layout().params]
        modules = sorted(
            {".".join(p.split(".")[:depth]) for p in params for depth in range(1, p.count(".") + 1)}
        )
        return params, modules
