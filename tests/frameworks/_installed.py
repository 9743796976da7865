"""The training frameworks these tests run (the ``frameworks`` extra: accelerate and
Lightning; the Trainer also needs ``transformers``, the ``hf`` extra).

:func:`require` skips a test where one is not installed, with the reason; with
``FSDPI_REQUIRE_FRAMEWORKS=1`` (set by CI) it fails instead, so CI cannot pass without
running them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = "FSDPI_REQUIRE_FRAMEWORKS"
EXTRA = {"accelerate": "frameworks", "lightning": "frameworks", "transformers": "hf"}


def require(*modules: str) -> None:
    """Skip (or, under ``FSDPI_REQUIRE_FRAMEWORKS=1``, fail) unless every module is there."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    extras = ",".join(sorted({EXTRA.get(m, m) for m in missing}))
    reason = f"{', '.join(missing)} not installed: pip install 'fsdp-interactive[{extras}]'"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires the framework tests to run)")
    pytest.skip(reason)


def modules_for(kind: str) -> tuple[str, ...]:
    """The frameworks a wrapping of :mod:`tests.checkpoint._wrappings` is built with."""
    if kind.startswith("accelerate"):
        return ("accelerate",)
    if kind.startswith("fabric"):
        return ("lightning",)
    return ()
