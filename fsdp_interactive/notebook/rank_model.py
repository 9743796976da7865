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

from typing import Any

from fsdp_interactive.inspect import (
    GradNormRecord,
    GradNorms,
    MemoryStats,
    ModelLayout,
    TensorStats,
    merge_layouts,
)
from fsdp_interactive.notebook._probe_input import ProbeInputError, input_error, norm_type_literal

_SCRATCH = "_fsdp_interactive_probe"


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

    def layout(self) -> ModelLayout:
        """The model's shard layout (:class:`~fsdp_interactive.inspect.ModelLayout`): units,
        parameters, which rank holds which slice, and the bytes each rank holds."""
        optimizer = self.optimizer or "None"
        # Every rank describes the same parameters: only rank 0 sends them (a model with
        # thousands of parameters would otherwise send and unpickle them once per rank).
        return merge_layouts(
            self._probe(
                f"_fsdp_interactive_inspect.layout({self.model}, {optimizer}, params_from_rank=0)"
            )
        )

    def grad_norms(self, norm_type: float = 2.0) -> GradNorms:
        """Gradient norms of ``norm_type`` (2.0, 1.0, ``float('inf')``, ...) per parameter and
        module and in total, as the framework's own ``clip_grad_norm_`` computes them; before
        the first backward the record says "no gradients yet"."""
        literal = norm_type_literal(norm_type, f"RankModel.grad_norms({norm_type!r})")
        return self._probe(f"_fsdp_interactive_inspect.grad_norms({self.model}, {literal})")[0]

    def summon(self, fqn: str, bins: int = 40) -> TensorStats:
        """Statistics of the full parameter ``fqn`` (clean or wrapped name) and a histogram of
        ``bins`` bins, computed where the shards are: no parameter is gathered."""
        return self._probe(
            f"_fsdp_interactive_inspect.summon_stats({self.model}, {fqn!r}, bins={int(bins)})",
            call=f"RankModel.summon({fqn!r})",
        )[0]

    def edit(self, fqn: str, expression: str, bins: int = 40) -> TensorStats:
        """Set the full parameter ``fqn`` to ``expression`` (Python evaluated on every rank, ``p``
        being the full parameter) and return its new statistics; only the units that own it are
        gathered."""
        return self._probe(
            f"_fsdp_interactive_inspect.edit_param({self.model}, {fqn!r}, {expression!r}, "
            f"bins={int(bins)})",
            call=f"RankModel.edit({fqn!r}, {expression!r})",
        )[0]

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
        return sorted(self._probe("_fsdp_interactive_inspect.memory()"), key=lambda m: m.rank)

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
