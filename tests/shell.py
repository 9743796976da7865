"""The one IPython shell of a test process."""

from __future__ import annotations

from typing import Any


def shared_shell() -> Any:
    """IPython's test shell, started on the first call and the same one afterwards.

    ``IPython.testing.globalipapp.start_ipython`` starts it once per process and returns
    ``None`` on every later call, so fixtures in different test files ask here instead.
    """
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    start_ipython()
    shell = get_ipython()
    if shell is None:
        raise RuntimeError("IPython's test shell did not start")
    return shell
