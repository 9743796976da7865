"""``RankModel``: run the inspect probes on a model that lives on the pool's ranks.

The model, optimizer and recorder are named by Python expressions evaluated in the
ranks' namespace (``"model"``, ``"trainer.model"``).  Each probe is one ``pool.run`` of a
code string that stores the probe's plain-data answer in a scratch variable, followed by
one ``pool.pull`` of it; the scratch variable is deleted again.  Nothing is gathered to the
kernel except the probes' small records.
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

    ``model``, ``optimizer`` and ``recorder`` are expressions evaluated on the ranks.
    Probes that are collectives (grad norms, summon, edit) run on every rank; layout and
    memory also run on every rank and are merged here.  Errors on the ranks propagate as
    the pool's ``RankError``. The model may be wrapped in any way
    :mod:`fsdp_interactive.wrapping` understands (torch FSDP1, DDP, ``torch.compile``, ...):
    the probes name parameters by their clean FQNs and accept the wrapped names too.
    """

    def __init__(
        self,
        pool: Any,
        model: str = "model",
        optimizer: str | None = None,
        recorder: str | None = None,
        timeout: float | None = 120.0,
    ):
        _check_expression("model", model)
        _check_expression("optimizer", optimizer, optional=True)
        _check_expression("recorder", recorder, optional=True)
        self.pool = pool
        self.model = model
        self.optimizer = optimizer
        self.recorder = recorder
        self.timeout = timeout

    def evaluate(self, expression: str, targets: list[int] | None = None) -> list[Any]:
        """Evaluate ``expression`` on the ranks; the per-rank values, in rank order.

        ``_fsdp_interactive_inspect`` and ``_fsdp_interactive_checkpoint`` (the inspect and
        checkpoint packages) are importable names inside ``expression``.  The values must
        be picklable plain data.
        """
        code = (
            "import fsdp_interactive.inspect as _fsdp_interactive_inspect\n"
            "import fsdp_interactive.checkpoint as _fsdp_interactive_checkpoint\n"
            f"{_SCRATCH} = {expression}\n"
        )
        self.pool.run(code, targets=targets, timeout=self.timeout, stream=False, journal=False)
        try:
            return list(self.pool.pull(_SCRATCH, targets=targets))
        finally:
            self.pool.run(
                f"del {_SCRATCH}, _fsdp_interactive_inspect, _fsdp_interactive_checkpoint",
                targets=targets,
                stream=False,
                journal=False,
            )

    _probe = evaluate

    def layout(self) -> ModelLayout:
        optimizer = self.optimizer or "None"
        # Every rank describes the same parameters: only rank 0 sends them (a model with
        # thousands of parameters would otherwise send and unpickle them once per rank).
        return merge_layouts(
            self._probe(
                f"_fsdp_interactive_inspect.layout({self.model}, {optimizer}, params_from_rank=0)"
            )
        )

    def grad_norms(self, norm_type: float = 2.0) -> GradNorms:
        return self._probe(
            f"_fsdp_interactive_inspect.grad_norms({self.model}, {float(norm_type)!r})"
        )[0]

    def summon(self, fqn: str, bins: int = 40) -> TensorStats:
        return self._probe(
            f"_fsdp_interactive_inspect.summon_stats({self.model}, {fqn!r}, bins={int(bins)})"
        )[0]

    def edit(self, fqn: str, expression: str, bins: int = 40) -> TensorStats:
        stats = self._probe(
            f"_fsdp_interactive_inspect.edit_param({self.model}, {fqn!r}, {expression!r}, "
            f"bins={int(bins)})"
        )[0]
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
        return sorted(self._probe("_fsdp_interactive_inspect.memory()"), key=lambda m: m.rank)

    def history(self, since: int = 0) -> list[GradNormRecord]:
        if self.recorder is None:
            raise ValueError(
                "no recorder: create RankModel(pool, recorder='recorder') naming a "
                "GradNormRecorder that lives on the ranks"
            )
        return self._probe(f"{self.recorder}.history(since={int(since)})")[0]

    def topology(self) -> list[Any]:
        return list(self.pool.topology)

    def names(self) -> tuple[list[str], list[str]]:
        """(parameter FQNs, module FQNs that own parameters), from the layout."""
        params = [p.fqn for p in self.layout().params]
        modules = sorted(
            {".".join(p.split(".")[:depth]) for p in params for depth in range(1, p.count(".") + 1)}
        )
        return params, modules
