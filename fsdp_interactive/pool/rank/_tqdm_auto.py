"""On a rank of the pool, ``tqdm.auto`` (and ``tqdm.autonotebook``) give the bar of
:mod:`._rank_bar`, whose states the notebook draws.

Rank side, standard library only (``tqdm`` itself is imported when user code imports
it, never here). ``tqdm.auto`` chooses its bar when ``tqdm.autonotebook`` is first
imported: the notebook widget when the process is an IPython kernel, which every engine
is. :func:`install` puts a finder first on ``sys.meta_path`` that answers the import of
``tqdm.autonotebook`` with a module whose ``tqdm`` is the rank bar; ``tqdm.auto`` then
builds its class on it as it would on the widget (``tqdm.asyncio``'s features included),
and so does every library that uses ``tqdm.auto`` (``transformers``, ``accelerate``).
Modules imported before :func:`install` are given the rank bar in place. Nothing is
imported until user code imports ``tqdm.auto``, so pools whose ranks never use it pay
nothing. Outside a pool (a ``torchrun`` job) nothing is installed.

Not done: ``tqdm.notebook`` and ``tqdm.tqdm`` are left as they are (the plain bar
prints text with carriage returns, which the notebook shows in place).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: ``publish(data, display_id, update)``: send one display of a bar (or an update of it).
Publish = Callable[[dict[str, Any], str, bool], None]

AUTONOTEBOOK = "tqdm.autonotebook"
AUTO = "tqdm.auto"


class _RankBarLoader(importlib.abc.Loader):
    """Fills ``tqdm.autonotebook`` with the rank bar."""

    def __init__(self, publish: Publish) -> None:
        self.publish = publish

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        _fill_autonotebook(module, self.publish)


class _RankBarFinder(importlib.abc.MetaPathFinder):
    def __init__(self, publish: Publish) -> None:
        self.loader = _RankBarLoader(publish)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != AUTONOTEBOOK:
            return None
        return importlib.util.spec_from_loader(fullname, self.loader)


def _fill_autonotebook(module: ModuleType, publish: Publish) -> None:
    from fsdp_interactive.pool.rank._rank_bar import bar_class

    bar = bar_class(publish)

    def trange(*args: Any, **kwargs: Any) -> Any:
        """``tqdm(range(*args), **kwargs)``."""
        return bar(range(*args), **kwargs)

    module.tqdm = bar  # type: ignore[attr-defined]
    module.trange = trange  # type: ignore[attr-defined]
    module.__all__ = ["tqdm", "trange"]  # type: ignore[attr-defined]


def _refill_auto(module: ModuleType, bar: type) -> None:
    """Rebuild ``tqdm.auto``'s class on ``bar``, as its own source builds it."""
    from tqdm.asyncio import tqdm as asyncio_tqdm

    class tqdm(bar, asyncio_tqdm):  # type: ignore[misc, valid-type]
        pass

    def trange(*args: Any, **kwargs: Any) -> Any:
        """``tqdm(range(*args), **kwargs)``."""
        return tqdm(range(*args), **kwargs)

    module.tqdm = tqdm  # type: ignore[attr-defined]
    module.trange = trange  # type: ignore[attr-defined]


def install(publish: Publish) -> None:
    """Make ``tqdm.auto`` on this process give bars that publish through ``publish``.

    Again with the same ``publish``: nothing changes (the bar classes modules already
    bound stay the ones ``tqdm.auto`` gives); with another: bars publish through it."""
    for finder in list(sys.meta_path):
        if isinstance(finder, _RankBarFinder):
            if finder.loader.publish is publish:
                return
            sys.meta_path.remove(finder)
    sys.meta_path.insert(0, _RankBarFinder(publish))
    loaded = sys.modules.get(AUTONOTEBOOK)
    if loaded is not None:
        _fill_autonotebook(loaded, publish)
        auto = sys.modules.get(AUTO)
        if auto is not None:
            _refill_auto(auto, loaded.tqdm)
