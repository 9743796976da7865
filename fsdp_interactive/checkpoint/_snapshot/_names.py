"""The variables that hold a snapshot's objects: found by identity when it is taken,
looked up again when it is restored.

Recovery replays the cells that created the model, the optimizer and the other objects,
then restores the snapshot into whatever those names hold now. So a snapshot records,
for each object, the name it has in the calling cell's namespace (the globals of the
frame that called :func:`snapshot`; in a pool's engine that is the user namespace, also
when the call sits inside a function the cell defined). Names starting with ``_``
(IPython's output history ``_``, ``_3``, ...) are not used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fsdp_interactive.checkpoint._stateful import Stateful
from fsdp_interactive.checkpoint.errors import SnapshotError

MODEL = "model"
OPTIMIZER = "optimizer"


def name_in(namespace: Mapping[str, Any], obj: Any) -> str | None:
    """The first public name in ``namespace`` bound to ``obj`` itself, or ``None``."""
    if obj is None:
        return None
    for name, value in namespace.items():
        if value is obj and isinstance(name, str) and not name.startswith("_"):
            return name
    return None


def record_names(
    namespace: Mapping[str, Any],
    model: Any,
    optimizer: Any,
    stateful: Mapping[str, Any],
) -> dict[str, Any]:
    """``{"model": name, "optimizer": name, "stateful": {keyword: name}}`` (``None`` where
    an object has no name in ``namespace``)."""
    return {
        MODEL: name_in(namespace, model),
        OPTIMIZER: name_in(namespace, optimizer),
        "stateful": {keyword: name_in(namespace, obj) for keyword, obj in stateful.items()},
    }


#: Why a snapshot may hold an object under no variable name.
NOT_A_GLOBAL = "the object was not a global of the code that took the snapshot"


def _find(
    keyword: str,
    name: str | None,
    namespace: Mapping[str, Any],
    objects: Mapping[str, Any],
    problems: list[str],
    unnamed: str,
) -> tuple[Any, str]:
    if keyword in objects:
        return objects[keyword], "<objects>"
    if name is None:
        problems.append(
            f"{keyword!r}: no variable name was recorded for it ({unnamed}); "
            f"pass objects={{{keyword!r}: ...}}"
        )
        return None, ""
    if name not in namespace:
        problems.append(
            f"{keyword!r} was the variable {name!r}, which is not defined now: run the "
            f"cells that define {name!r} first, or pass objects={{{keyword!r}: ...}}"
        )
        return None, ""
    return namespace[name], name


def resolve(
    names: Mapping[str, Any],
    has_optimizer: bool,
    namespace: Mapping[str, Any],
    objects: Mapping[str, Any],
    unnamed: str = NOT_A_GLOBAL,
) -> tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any], dict[str, str]]:
    """The model, optimizer (when the snapshot holds optimizer state) and stateful objects
    a snapshot restores into, and the name each came from; :class:`SnapshotError` listing
    every object that cannot be found or has the wrong kind.

    ``objects`` (keyword -> object) overrides the recorded names; ``unnamed`` says why a
    name may be missing (in the error that asks for ``objects``).
    """
    if not isinstance(namespace, Mapping):
        raise TypeError(
            f"namespace must be a mapping of names (e.g. globals()), got {type(namespace).__name__}"
        )
    held = [MODEL, *([OPTIMIZER] if has_optimizer else []), *names.get("stateful", {})]
    unknown = sorted(set(objects) - set(held))
    if unknown:
        raise ValueError(
            f"objects names {unknown}, which the snapshot does not hold; it holds {held}"
        )
    problems: list[str] = []
    used: dict[str, str] = {}
    model, used[MODEL] = _find(MODEL, names.get(MODEL), namespace, objects, problems, unnamed)
    if model is not None and not isinstance(model, nn.Module):
        problems.append(f"'model' ({used[MODEL]}) is a {type(model).__name__}, not a torch module")
    optimizer = None
    if has_optimizer:
        optimizer, used[OPTIMIZER] = _find(
            OPTIMIZER, names.get(OPTIMIZER), namespace, objects, problems, unnamed
        )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            problems.append(
                f"'optimizer' ({used[OPTIMIZER]}) is a {type(optimizer).__name__}, "
                "not a torch optimizer"
            )
    stateful = {}
    for keyword, name in names.get("stateful", {}).items():
        obj, used[keyword] = _find(keyword, name, namespace, objects, problems, unnamed)
        if obj is not None and not isinstance(obj, Stateful):
            problems.append(
                f"{keyword!r} ({used[keyword]}) is a {type(obj).__name__}, without "
                "state_dict()/load_state_dict()"
            )
        stateful[keyword] = obj
    if problems:
        raise SnapshotError(
            "cannot restore the snapshot: its objects are not all there: " + "; ".join(problems)
        )
    return model, optimizer, stateful, used
