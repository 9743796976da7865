"""Checks the framework tests make from the notebook side, on a model the ranks hold."""

from __future__ import annotations

import ast

import pytest

from fsdp_interactive.pool import Pool
from tests.frameworks._probes import KIT_VIEWS


def check_kit_views(pool: Pool, model: str) -> None:
    """The kit's layout of the model named ``model`` on the ranks lists the recipes' Llama by
    its clean names, and its gradient norm is the one the framework's own
    ``clip_grad_norm_`` computes, to 1e-5, whatever the framework wrapped the model in."""
    code = "from tests.frameworks._probes import kit_views\n" + KIT_VIEWS.format(model=model)
    results = pool.run(code, stream=False, journal=False).results
    for rank, text in results.items():
        seen, clean = ast.literal_eval(text)
        assert seen["names"] == clean, (model, rank, seen["names"])
        assert seen["grad_norm"] == pytest.approx(seen["framework_grad_norm"], rel=1e-5), (
            model,
            rank,
            seen,
        )
