"""Session-wide fixtures: rank groups are started once and shared by every test."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.multirank import RankGroup


def _group(world_size: int) -> Iterator[RankGroup]:
    group = RankGroup(world_size)
    try:
        yield group.start()
    finally:
        group.close()


@pytest.fixture(scope="session")
def ranks2() -> Iterator[RankGroup]:
    """Two gloo ranks, started once per test session."""
    yield from _group(2)


@pytest.fixture(scope="session")
def ranks4() -> Iterator[RankGroup]:
    """Four gloo ranks, started once per test session."""
    yield from _group(4)


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C raises KeyboardInterrupt in this process, as in a notebook kernel running a cell.

    A shell that starts pytest as a background job (``make test &``, a CI runner without
    job control) starts it with SIGINT ignored, and Python keeps an inherited SIG_IGN; the
    tests that press Ctrl-C on this process would then wait for an interrupt that never
    comes.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``cuda`` where no CUDA device is present."""
    cuda_items = [item for item in items if "cuda" in item.keywords]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in cuda_items:
        item.add_marker(skip)
