"""One real 2-rank pool for the framework tests, with the recipes' model and data defined.

The recipes come from docs/frameworks.md (:mod:`tests.frameworks._recipes`), so what the
page shows is what runs here. Where accelerate, Lightning or transformers is missing the
tests skip, or fail under ``FSDPI_REQUIRE_FRAMEWORKS=1`` (:mod:`tests.frameworks._installed`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fsdp_interactive.pool import Pool
from tests.frameworks._recipes import recipe


@pytest.fixture(scope="session")
def framework_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """A 2-rank CPU pool; the ``setup`` recipe (the Llama config and the data) has run."""
    from tests.frameworks._installed import require

    require("transformers")
    pool = Pool(
        2,
        devices="cpu",
        profile_dir=str(tmp_path_factory.mktemp("frameworks-profile")),
        show_topology=False,
    )
    try:
        pool.start()
        pool.run(recipe("setup"), stream=False)
        yield pool
    finally:
        pool.stop()
