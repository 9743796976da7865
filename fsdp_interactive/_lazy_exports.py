"""Names a package exports without importing them before they are first used, and the
names ``dir()`` shows of a public namespace.

A package whose users in the notebook kernel must not import torch (or matplotlib) for
names they never touch lists those names with the modules they come from and installs
what :func:`lazy_exports` returns as its ``__getattr__`` and ``__dir__``. Any other public
module installs :func:`public_names` as its ``__dir__``, so that ``dir()`` and tab
completion show what the module exports (its ``__all__``) and not what it imported for
itself (``annotations``, ``Any``, helper modules).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` (its ``__name__``, called while it
    is imported): each name of ``table`` is imported from the module it maps to when first
    asked for, then kept in the package's namespace; any other name raises
    ``AttributeError``. ``__dir__`` is :func:`public_names`: the package's ``__all__``
    (``table`` while it has none)."""
    namespace = sys.modules[package].__dict__

    def get(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return get, public_names(package, default=table)


def public_names(module: str, default: Iterable[str] = ()) -> Callable[[], list[str]]:
    """``__dir__`` for ``module`` (its ``__name__``): the names of its ``__all__``, sorted,
    read when ``dir()`` is called (``default`` while the module has no ``__all__``)."""
    namespace = sys.modules[module].__dict__

    def names() -> list[str]:
        return sorted(namespace.get("__all__", default))

    return names
