"""FSDP1 arguments warn only when the user passed a value that behaves differently here, and
wrapping decisions are logged (silent unless a user turns the loggers on)."""

from __future__ import annotations

import logging
import warnings

import torch

from tests.fsdp import _common as C
from tests.models import Block, TinyLM


def fsdp1_argument_warnings() -> dict[str, list[str]]:
    from fsdp_interactive.fsdp import BackwardPrefetch, MixedPrecision, _config
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    def caught_while(*builds: dict) -> list[str]:
        _config._warned.clear()  # warnings are once per process: start from none shown
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for kwargs in builds:
                FSDP(C.make_model(0), **kwargs)
        return [f"{w.category.__name__}: {w.message}" for w in caught]

    policy = ModuleWrapPolicy({Block})
    return {
        "defaults": caught_while({}, {"auto_wrap_policy": policy}),
        "fsdp1_defaults_passed_explicitly_except_use_orig_params": caught_while(
            {
                "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
                "limit_all_gathers": True,
                "forward_prefetch": False,
                "use_orig_params": True,
                "auto_wrap_policy": policy,
            }
        ),
        "changed_meaning": caught_while(
            {
                "backward_prefetch": BackwardPrefetch.BACKWARD_POST,
                "limit_all_gathers": False,
                "mixed_precision": MixedPrecision(
                    param_dtype=torch.bfloat16, keep_low_precision_grads=True
                ),
                "use_orig_params": False,
            },
            {"backward_prefetch": BackwardPrefetch.BACKWARD_POST, "use_orig_params": False},
        ),
    }


def test_defaults_do_not_warn_and_each_changed_meaning_warns_once(ranks2):
    result = ranks2.run(fsdp1_argument_warnings)[0]
    assert result["defaults"] == []
    assert result["fsdp1_defaults_passed_explicitly_except_use_orig_params"] == []
    messages = result["changed_meaning"]
    for needle in ("BACKWARD_POST", "limit_all_gathers", "keep_low_precision_grads"):
        assert sum(needle in m for m in messages) == 1, (needle, messages)
    orig = [m for m in messages if m.startswith("UserWarning: use_orig_params=False")]
    assert len(orig) == 1, messages


def test_signature_shows_fsdp1_defaults():
    import inspect

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    parameters = inspect.signature(FSDP.__init__).parameters
    assert repr(parameters["use_orig_params"].default) == "False"
    assert parameters["limit_all_gathers"].default is True
    assert "use_orig_params: 'bool' = False" in str(inspect.signature(FSDP.__init__))


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def wrapping_log() -> dict[str, list[str]]:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    logger = logging.getLogger("fsdp_interactive.fsdp")
    silent = _Collect()
    logger.addHandler(silent)  # level left as it is: nothing below WARNING gets through
    try:
        FSDP(C.make_model(0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    finally:
        logger.removeHandler(silent)

    collect = _Collect()
    logger.addHandler(collect)
    logger.setLevel(logging.DEBUG)
    try:
        with torch.device("meta"):
            meta_model = TinyLM()
        FSDP(meta_model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    finally:
        logger.removeHandler(collect)
        logger.setLevel(logging.NOTSET)
    return {"silent": silent.lines, "debug": collect.lines}


def test_wrapping_is_logged_at_debug_level_only(ranks2):
    result = ranks2.run(wrapping_log)[0]
    assert result["silent"] == []
    lines = result["debug"]
    text = "\n".join(lines)
    for path in ("blocks.0", "blocks.1"):
        assert any(f"auto-wrap: '{path}' (Block) is a unit" in line for line in lines), text
    assert sum("materializing" in line for line in lines) == 3, text  # two blocks + root
    assert any(
        "fsdp_interactive.fsdp._config: FULL_SHARD: 1-D mesh of shape (2,)" in line
        for line in lines
    ), text
    assert (
        sum("unit around" in line and "(materialized from meta)" in line for line in lines) == 3
    ), text
