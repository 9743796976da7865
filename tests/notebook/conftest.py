"""One real IPython shell with the extension loaded and one real 2-rank pool per session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.shell import shared_shell


@pytest.fixture(scope="session")
def shell() -> Any:
    ip = shared_shell()
    ip.run_line_magic("load_ext", "fsdp_interactive")
    return ip


@pytest.fixture(scope="session")
def pool_shell(shell: Any) -> Iterator[Any]:
    """The shell after ``%fsdp start -n 2 --backend gloo``; the pool is stopped at the end."""
    from fsdp_interactive.notebook.magics import current_pool

    try:
        shell.run_line_magic("fsdp", "start -n 2 --backend gloo")
        yield shell
    finally:
        pool = current_pool()
        if pool is not None:
            pool.stop()
        shell.run_line_magic("fsdp", "stop")


@pytest.fixture()
def pool(pool_shell: Any) -> Any:
    from fsdp_interactive.notebook.magics import current_pool

    running = current_pool()
    if running is None or not running.running:
        pool_shell.run_line_magic("fsdp", "restart")
        running = current_pool()
    return running
