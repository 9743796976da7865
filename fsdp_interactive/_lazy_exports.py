"""Names a package exports without importing them before they are first used.

A package whose users in the notebook kernel must not import torch (or matplotlib) for
names they never touch lists those names with the modules they come from and installs
what :func:`lazy_exports` returns as its ``__getattr__`` and ``__dir__``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` (its ``__name__``, called while it
    is imported): each name of ``table`` is imported from the module it maps to when first
    asked for, then kept in the package's namespace; any other name raises
    ``AttributeError``."""
    namespace = sys.modules[package].__dict__

    def get(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def names() -> list[str]:
        return sorted(set(namespace) | set(table))

    return get, names
