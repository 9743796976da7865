"""A one-rank group (a world-size-1 process group in its own process) for resharding tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multirank import RankGroup


@pytest.fixture(scope="session")
def ranks1() -> Iterator[RankGroup]:
    group = RankGroup(1)
    try:
        yield group.start()
    finally:
        group.close()
