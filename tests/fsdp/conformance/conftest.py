"""Fixtures of the conformance suite: every check runs on 2 and on 4 ranks, and the world
size 1 checks on a group of one rank of their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multirank import RankGroup


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request: pytest.FixtureRequest) -> RankGroup:
    """The session's group of 2, then of 4 gloo ranks (``ranks2`` / ``ranks4``)."""
    return request.getfixturevalue(f"ranks{request.param}")


@pytest.fixture(scope="session")
def ranks1() -> Iterator[RankGroup]:
    """One gloo rank in a process of its own: torch's FSDP1 switches every sharding
    strategy to NO_SHARD there, which only a world of one shows."""
    group = RankGroup(1)
    try:
        yield group.start()
    finally:
        group.close()
