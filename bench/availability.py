"""Is a component of ours importable yet?  Figures ask before measuring it.

:func:`missing` returns ``None`` when ``module`` imports and has every name in ``attrs``,
and otherwise the reason, phrased for the report ("not available yet: ...").  It never
guesses a number for a missing component; the figure then shows the baselines alone.
"""

from __future__ import annotations

import importlib


def missing(module: str, *attrs: str) -> str | None:
    """``None`` if ``module`` and its ``attrs`` exist, else why not."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return f"not available yet: `import {module}` fails ({type(exc).__name__}: {exc})"
    absent = [name for name in attrs if not hasattr(mod, name)]
    if absent:
        return f"not available yet: {module} has no {', '.join(absent)}"
    return None
