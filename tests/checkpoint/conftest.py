"""A one-rank group (a world-size-1 process group in its own process) for resharding
tests, and the snapshot placement variables put back after every test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.checkpoint._snapshots import HOST_ENV, KEY_ENV, ROOT_ENV
from tests.multirank import RankGroup


@pytest.fixture(autouse=True)
def _snapshot_placement_restored() -> Iterator[None]:
    """Tests that list a simulated host's snapshots in this process set its placement
    variables here; they are put back afterwards, so that later tests, and the processes
    they start (engine forkers), do not inherit a test's snapshot folder."""
    saved = {name: os.environ.get(name) for name in (ROOT_ENV, HOST_ENV, KEY_ENV)}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def ranks1() -> Iterator[RankGroup]:
    group = RankGroup(1)
    try:
        yield group.start()
    finally:
        group.close()
