"""Where a snapshot's objects live: found by identity when it is taken, looked up again when
it is restored.

Recovery replays the cells that created the model, the optimizer and the other objects,
then restores the snapshot into whatever is found where they were. So a snapshot records,
for each object, its *location* in the calling code's namespace (the globals of the frame
that called :func:`snapshot`; in a pool's engine that is the user namespace, also when the
call sits inside a function the cell defined):

* what the caller wrote, when it is a variable or an attribute path from one
  (``snapshot(model=run.model)`` records ``run.model``, also where a variable ``m`` holds
  the same object) and names that object in the namespace (:func:`given_paths` reads the
  call's source);
* otherwise, where the object is found: a variable (``model``), or, for an object that no
  variable holds, an attribute path from one (``trainer.model_wrapped``,
  ``trainer.optimizer``: what a Hugging Face ``Trainer`` builds inside ``train()``), at
  most :data:`MAX_DEPTH` attributes deep (instance attributes, and a module's children);
  a variable before a path, a shorter path before a longer one.

Names starting with ``_`` (IPython's output history ``_``, ``_3``, ...) are not used.

Inside a pool's notebook call an object without a location is refused when the snapshot is
taken (:class:`SnapshotObjectsError`, saying how to make it findable), since a recovery
could not put it back; elsewhere (a script, a test) its location is ``None`` and a restore
takes it through ``objects=``. There a location whose variable a recovery would not bind
again (:func:`fsdp_interactive._notices.unreplayed`: one bound only in a ``--no-replay``
cell, in the cell taking the snapshot, or by ``Pool.push``) is re-pointed to another
location of the same object that it would bind, or refused, with the reason
(:func:`findable`).
"""

from __future__ import annotations

import ast
import itertools
import linecache
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fsdp_interactive import _notices
from fsdp_interactive.checkpoint._stateful import Stateful
from fsdp_interactive.checkpoint.errors import SnapshotObjectsError

MODEL = "model"
OPTIMIZER = "optimizer"
#: How many attributes deep a location may go (``trainer.model_wrapped`` is 1).
MAX_DEPTH = 2
#: Objects looked into at most while searching, so that a namespace holding huge object
#: graphs cannot make a snapshot slow.
_MAX_VISITS = 20_000
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    torch.Tensor,
    str,
    bytes,
    int,
    float,
)


def name_in(namespace: Mapping[str, Any], obj: Any) -> str | None:
    """The first public name in ``namespace`` bound to ``obj`` itself, or ``None``."""
    if obj is None:
        return None
    for name, value in list(namespace.items()):
        if value is obj and isinstance(name, str) and not name.startswith("_"):
            return name
    return None


def _attributes(value: Any) -> Iterator[tuple[str, Any]]:
    """The public attributes a location may go through: a module's children, another
    object's instance attributes (never properties: nothing is computed)."""
    if isinstance(value, _OPAQUE):
        return
    if isinstance(value, nn.Module):
        yield from ((n, c) for n, c in value.named_children() if not n.startswith("_"))
        return
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        for name, attribute in list(attributes.items()):
            if isinstance(name, str) and not name.startswith("_") and attribute is not None:
                yield name, attribute


def locations(namespace: Mapping[str, Any], obj: Any) -> Iterator[str]:
    """Every location of ``obj`` in ``namespace``: public names first, then attribute
    paths from them, shorter before longer (at most :data:`MAX_DEPTH` attributes)."""
    if obj is None:
        return
    level = [
        (name, value)
        for name, value in list(namespace.items())
        if isinstance(name, str) and not name.startswith("_")
    ]
    yield from (name for name, value in level if value is obj)
    seen = {id(value) for _, value in level}
    visits = 0
    for _ in range(MAX_DEPTH):
        deeper = []
        for path, value in level:
            for name, attribute in _attributes(value):
                if attribute is obj:
                    yield f"{path}.{name}"
                visits += 1
                if id(attribute) not in seen and visits < _MAX_VISITS:
                    seen.add(id(attribute))
                    deeper.append((f"{path}.{name}", attribute))
        level = deeper


def locate(namespace: Mapping[str, Any], obj: Any) -> str | None:
    """Where ``obj`` is in ``namespace``: a public name, else the shortest attribute path
    from one (at most :data:`MAX_DEPTH` attributes), else ``None``."""
    return next(locations(namespace, obj), None)


def _dotted(node: ast.expr) -> str | None:
    """``run.model`` for an expression that is a name or an attribute path, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def given_paths(frame: types.FrameType | None, keywords: tuple[str, ...]) -> dict[str, str]:
    """What the call being made in ``frame`` passes for each of ``keywords`` (the
    positional parameters first, in order) when it is a variable or an attribute path:
    ``{"model": "run.model"}`` for ``snapshot(model=run.model)``. Read from the call's
    source (the notebook's cell); ``{}`` when the source cannot be read."""
    if frame is None:
        return {}
    try:
        # One position per 2-byte code unit: the call's is that of its last instruction.
        where = next(itertools.islice(frame.f_code.co_positions(), frame.f_lasti // 2, None))
        first, last, start, end = where
        if None in where:
            return {}
        lines = linecache.getlines(frame.f_code.co_filename, frame.f_globals)[first - 1 : last]
        if not lines:
            return {}
        raw = [line.encode("utf-8") for line in lines]
        raw[-1] = raw[-1][:end]
        raw[0] = raw[0][start:]
        call = ast.parse("(" + b"".join(raw).decode("utf-8") + ")", mode="eval").body
    except (SyntaxError, ValueError, IndexError, StopIteration, UnicodeDecodeError):
        return {}
    if not isinstance(call, ast.Call):
        return {}
    given = {}
    for keyword, node in zip(keywords, call.args, strict=False):
        if (path := _dotted(node)) is not None:
            given[keyword] = path
    for item in call.keywords:
        if item.arg is not None and (path := _dotted(item.value)) is not None:
            given[item.arg] = path
    return given


def follow(namespace: Mapping[str, Any], path: str) -> Any:
    """The object at ``path`` (``name`` or ``name.attr...``) in ``namespace``, or ``None``."""
    root, *attributes = path.split(".")
    value = namespace.get(root)
    for attribute in attributes:
        value = getattr(value, attribute, None)
    return value


def _location(namespace: Mapping[str, Any], obj: Any, given: str | None) -> str | None:
    if obj is None:
        return None
    usable = given is not None and not given.split(".", 1)[0].startswith("_")
    if usable and follow(namespace, given) is obj:
        return given
    return locate(namespace, obj)


def record_names(
    namespace: Mapping[str, Any],
    model: Any,
    optimizer: Any,
    stateful: Mapping[str, Any],
    given: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``{"model": location, "optimizer": location, "stateful": {keyword: location}}``
    (``None`` where an object has no location in ``namespace``, or was not given);
    ``given``: what the caller wrote for each keyword, used where it names the object."""
    given = given or {}
    return {
        MODEL: _location(namespace, model, given.get(MODEL)),
        OPTIMIZER: _location(namespace, optimizer, given.get(OPTIMIZER)),
        "stateful": {k: _location(namespace, o, given.get(k)) for k, o in stateful.items()},
    }


def findable(
    namespace: Mapping[str, Any], names: dict[str, Any], objects: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str], SnapshotObjectsError | None]:
    """``names`` with every location whose root a recovery would not bind again
    (:func:`fsdp_interactive._notices.unreplayed`) re-pointed to one it would bind
    (``objects``: keyword -> object); the notes saying what was re-pointed and why, and
    the refusal when an object has no such location (``None``: none)."""
    names = {**names, "stateful": dict(names.get("stateful") or {})}
    notes: list[str] = []
    problems: list[str] = []

    def why_not(location: str) -> str | None:
        root = location.split(".", 1)[0]
        return _notices.unreplayed(root, namespace.get(root), namespace)

    def settle(keyword: str, location: str | None) -> str | None:
        if location is None:
            return None
        reason = why_not(location)
        if reason is None:
            return location
        other = next((w for w in locations(namespace, objects[keyword]) if not why_not(w)), None)
        if other is None:
            problems.append(f"{keyword}={location}: {reason}")
            return location
        notes.append(f"{keyword!r} is recorded at {other}, not {location}: {reason}")
        return other

    names[MODEL] = settle(MODEL, names.get(MODEL))
    if OPTIMIZER in objects:
        names[OPTIMIZER] = settle(OPTIMIZER, names.get(OPTIMIZER))
    for keyword in names["stateful"]:
        names["stateful"][keyword] = settle(keyword, names["stateful"][keyword])
    if not problems:
        return names, notes, None
    return (
        names,
        notes,
        SnapshotObjectsError(
            "snapshot(" + ", ".join(p.split(":", 1)[0] for p in problems) + "): a recovery "
            "could not find "
            + ("it" if len(problems) == 1 else "them")
            + " again, since it replays only the cells that bind them and would not bind "
            + ("this one" if len(problems) == 1 else "these")
            + ": "
            + "; ".join(problems)
            + ". Pass each object where a cell that a recovery replays keeps it (e.g. "
            "model=run.model rather than an alias made in a --no-replay cell), or bind "
            "the variable in a cell before this one that is not marked --no-replay; "
            "nothing was written",
            missing=[p.split("=", 1)[0] for p in problems],
        ),
    )


def unlocated_error(
    names: Mapping[str, Any], optimizer: Any, stateful: Mapping[str, Any]
) -> SnapshotObjectsError | None:
    """The refusal of a snapshot taken in a notebook call whose objects are not all
    findable again (``names`` from :func:`record_names`); ``None`` when they are."""
    missing = [MODEL] if names[MODEL] is None else []
    missing += [OPTIMIZER] if optimizer is not None and names[OPTIMIZER] is None else []
    missing += [k for k in stateful if names["stateful"].get(k) is None]
    if not missing:
        return None
    given = ", ".join(f"{k}=..." for k in missing)
    return SnapshotObjectsError(
        f"snapshot({given}): {', '.join(repr(k) for k in missing)} "
        f"{'is' if len(missing) == 1 else 'are'} neither a variable of the notebook's "
        f"namespace nor an attribute of one (searched {MAX_DEPTH} attributes deep, as in "
        "trainer.model_wrapped), so a recovery could not find "
        f"{'it' if len(missing) == 1 else 'them'} again after replaying the cells. Assign "
        "each to a variable in a cell (e.g. model = ..., then snapshot(model=model)), or "
        "keep it as an attribute of one; nothing was written",
        missing=missing,
    )


#: Why a snapshot may hold an object under no location.
NOT_A_GLOBAL = "the object was not a global of the code that took the snapshot"


def _found(namespace: Mapping[str, Any], path: str) -> tuple[Any, str | None]:
    """The object at ``path`` (``name`` or ``name.attr...``), or why it is not there."""
    root, *attributes = path.split(".")
    if root not in namespace:
        return None, (
            f"was the variable {root!r}, which is not defined now: run the cells that "
            f"define {root!r} first"
            if not attributes
            else f"was at {path}, but {root!r} is not defined now: run the cells that "
            f"define {root!r} first"
        )
    value, walked = namespace[root], root
    for attribute in attributes:
        walked = f"{walked}.{attribute}"
        value = getattr(value, attribute, None)
        if value is None:
            return None, (
                f"was at {path}, and {walked} is None or missing now: the cells that ran "
                f"again did not build it (an object a framework builds inside a call "
                "that is not replayed, such as trainer.train(), must be built in a cell "
                "that is: for the Hugging Face Trainer, trainer.create_optimizer() after "
                "creating it; see docs/recovery.md)"
            )
    return value, None


def _find(
    keyword: str,
    location: str | None,
    namespace: Mapping[str, Any],
    objects: Mapping[str, Any],
    problems: list[str],
    unnamed: str,
) -> tuple[Any, str]:
    if keyword in objects:
        return objects[keyword], "<objects>"
    if location is None:
        problems.append(
            f"{keyword!r}: no variable name was recorded for it ({unnamed}); "
            f"pass objects={{{keyword!r}: ...}}"
        )
        return None, ""
    value, why = _found(namespace, location)
    if why is not None:
        problems.append(f"{keyword!r} {why}, or pass objects={{{keyword!r}: ...}}")
        return None, ""
    return value, location


def resolve(
    names: Mapping[str, Any],
    has_optimizer: bool,
    namespace: Mapping[str, Any],
    objects: Mapping[str, Any],
    unnamed: str = NOT_A_GLOBAL,
) -> tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any], dict[str, str]]:
    """The model, optimizer (when the snapshot holds optimizer state) and stateful objects
    a snapshot restores into, and the location each came from;
    :class:`SnapshotObjectsError` listing every object that cannot be found or has the
    wrong kind.

    ``objects`` (keyword -> object) overrides the recorded locations; ``unnamed`` says why
    a location may be missing (in the error that asks for ``objects``).
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
    missing: list[str] = []

    def find(keyword: str, location: str | None) -> tuple[Any, str]:
        count = len(problems)
        found = _find(keyword, location, namespace, objects, problems, unnamed)
        if len(problems) > count:
            missing.append(keyword)
        return found

    def wrong(keyword: str, where: str, value: Any, expected: str) -> None:
        problems.append(f"{keyword!r} ({where}) is a {type(value).__name__}, {expected}")
        missing.append(keyword)

    used: dict[str, str] = {}
    model, used[MODEL] = find(MODEL, names.get(MODEL))
    if model is not None and not isinstance(model, nn.Module):
        wrong(MODEL, used[MODEL], model, "not a torch module")
    optimizer = None
    if has_optimizer:
        optimizer, used[OPTIMIZER] = find(OPTIMIZER, names.get(OPTIMIZER))
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            wrong(OPTIMIZER, used[OPTIMIZER], optimizer, "not a torch optimizer")
    stateful = {}
    for keyword, location in names.get("stateful", {}).items():
        obj, used[keyword] = find(keyword, location)
        if obj is not None and not isinstance(obj, Stateful):
            wrong(keyword, used[keyword], obj, "without state_dict()/load_state_dict()")
        stateful[keyword] = obj
    if problems:
        raise SnapshotObjectsError(
            "cannot restore the snapshot: its objects are not all there: " + "; ".join(problems),
            missing=missing,
        )
    return model, optimizer, stateful, used
