"""The modules a cell's source imports, as import specs for the engine forkers' warm
imports (:mod:`.processes._warm_imports`).

Read from the source with :mod:`ast`, never by running it: every ``import a.b`` gives
``"a.b"``, every ``from a.b import c`` gives ``"a.b:c"`` (``from a.b import *``:
``"a.b"``), wherever it stands (imports inside functions count: they run when the
function is called). Relative imports name the notebook's own modules and are left out.
Lines of IPython syntax (``%magic``, ``!shell``) are blanked first; a cell that still
does not parse gives nothing.
"""

from __future__ import annotations

import ast
import os

#: ``FSDPI_WARM_IMPORTS=0`` turns warm imports off.
ENV_VAR = "FSDPI_WARM_IMPORTS"


def enabled() -> bool:
    """Whether warm imports are on (they are unless ``$FSDPI_WARM_IMPORTS`` is ``0``)."""
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "false", "no", "off")


def parse(source: str) -> ast.Module | None:
    """``source`` as a module, with lines of IPython syntax blanked; ``None`` when it does
    not parse."""
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        pass
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except (SyntaxError, ValueError):
        return None


def import_specs(source: str) -> list[str]:
    """The import specs of ``source``, in order, each once."""
    tree = parse(source)
    if tree is None:
        return []
    specs: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            specs += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            specs += [
                node.module if alias.name == "*" else f"{node.module}:{alias.name}"
                for alias in node.names
            ]
    return list(dict.fromkeys(specs))
