"""The Hugging Face tests need ``transformers`` (the ``hf`` extra; ``make setup`` installs
it). Without it every test here is skipped with the reason; with ``FSDPI_REQUIRE_HF=1``
(set by CI) each fails instead, so CI cannot pass without running them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = "FSDPI_REQUIRE_HF"


# Session scope: set up before the session-scoped rank groups, so none is started in vain.
@pytest.fixture(scope="session", autouse=True)
def _transformers_installed() -> None:
    """Skip (or, with ``FSDPI_REQUIRE_HF=1``, fail) where transformers is not installed."""
    if importlib.util.find_spec("transformers") is not None:
        return
    reason = "transformers is not installed: pip install 'fsdp-interactive[hf]'"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires the Hugging Face tests to run)")
    pytest.skip(reason)
