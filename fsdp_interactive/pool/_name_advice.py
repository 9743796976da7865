"""A rank's ``NameError`` for a name the kernel has: the error says to push it.

Kernel side. Code sent to the ranks runs in each engine's own namespace, not the
kernel's: a cell that uses ``lr`` defined in a notebook cell (not a ``%%fsdp`` one) fails
on every rank with ``NameError: name 'lr' is not defined``. When the caller's namespace
(the running IPython shell's, else ``__main__``'s) holds such a name, :func:`advise_push`
makes sending it the first thing the :class:`~.errors.RankError` names to do:
``%fsdp push lr`` for a notebook user, ``pool.push({'lr': lr})`` for an API caller. Names
the kernel does not have get no such advice (the cell misspelt one, or must define it).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

from fsdp_interactive.pool.errors import RankError, Step

_UNDEFINED = re.compile(r"name '([A-Za-z_]\w*)' is not defined")


def caller_namespace() -> Mapping[str, Any]:
    """The names the caller typed its code among: the running IPython shell's user
    namespace, else the ``__main__`` module's globals (a script)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        return shell.user_ns
    main = sys.modules.get("__main__")
    return vars(main) if main is not None else {}


def kernel_names(error: RankError, namespace: Mapping[str, Any]) -> list[str]:
    """The names the ranks' ``NameError``s say are undefined and ``namespace`` holds, in
    the order the ranks name them."""
    names = []
    for ename, message in error.errors.values():
        found = _UNDEFINED.search(message) if ename == "NameError" else None
        if found and found.group(1) in namespace and found.group(1) not in names:
            names.append(found.group(1))
    return names


def advise_push(error: RankError, namespace: Mapping[str, Any] | None = None) -> RankError:
    """``error`` with pushing the kernel's names first among what it says to do, when
    its ranks lack names the caller's ``namespace`` (default :func:`caller_namespace`)
    has; returned for ``raise advise_push(RankError(...))``."""
    names = kernel_names(error, caller_namespace() if namespace is None else namespace)
    if names:
        mapping = ", ".join(f"{name!r}: {name}" for name in names)
        push = Step(
            f"send the kernel's {', '.join(names)} to the ranks with {{}}",
            f"pool.push({{{mapping}}})",
            f"%fsdp push {' '.join(names)}",
        )
        error.advise(push, *error.advice)
    return error
