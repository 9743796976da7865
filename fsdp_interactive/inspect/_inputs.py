"""What a probe is given, checked where it runs: the ranks' variables a view names, and the
arguments of the probes (rank side).

A probe or view names the model, optimizer and recorder by Python expressions evaluated in
the ranks' namespace (``"model"``, ``"trainer.model"``). :func:`check_sources` evaluates
them once, when the view's source is made, and says for each what is wrong with it: a
name the ranks do not have (with the close matches among their variables, those of the
right kind first), an attribute the object does not have, a value of the wrong kind.
:class:`ProbeInputError` is what a probe raises for an argument the caller got wrong (a
module given where a parameter is edited, an expression of the wrong shape); together
with :class:`fsdp_interactive.wrapping.UnknownName` it marks an error of the caller's
input, which the notebook side raises as a short error of its own, without the rank's
traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fsdp_interactive._text import did_you_mean

#: The kinds of value a source may name, and how a message calls each.
KINDS: dict[str, tuple[str, str]] = {
    "module": ("a torch.nn.Module", "models"),
    "optimizer": ("a torch.optim.Optimizer", "optimizers"),
    "recorder": ("a GradNormRecorder", "recorders"),
}


class ProbeInputError(ValueError):
    """A probe's argument that the caller got wrong; the message says what to give."""


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "module":
        return isinstance(value, nn.Module)
    if kind == "optimizer":
        return isinstance(value, torch.optim.Optimizer)
    from fsdp_interactive.inspect import GradNormRecorder

    return isinstance(value, GradNormRecorder)


def check_sources(namespace: Mapping[str, Any], sources: Mapping[str, tuple[str, str]]) -> dict:
    """For each ``argument: (expression, kind)`` of ``sources`` (``kind``: a key of
    :data:`KINDS`), what is wrong with ``expression`` evaluated in ``namespace`` (the
    rank's user namespace); arguments without a problem are left out. Nothing is raised.
    """
    problems: dict[str, str] = {}
    for argument, (expression, kind) in sources.items():
        try:
            value = eval(expression, dict(namespace))  # what the probes evaluate anyway
        except NameError as error:
            problems[argument] = _unknown_variable(expression, error.name, namespace, kind)
        except AttributeError as error:
            problems[argument] = _unknown_attribute(expression, error, kind)
        except Exception as error:
            problems[argument] = (
                f"{expression!r} fails on the ranks: {type(error).__name__}: {error}"
            )
        else:
            if not _is_kind(value, kind):
                what, plural = KINDS[kind]
                found = _of_kind(namespace, kind)
                problems[argument] = (
                    f"{expression!r} is a {type(value).__name__} on the ranks, not {what}"
                    + (f"; the ranks' {plural}: {', '.join(found)}" if found else "")
                )
    return problems


def _of_kind(namespace: Mapping[str, Any], kind: str) -> list[str]:
    """The public variables of ``namespace`` that hold a value of ``kind``, sorted."""
    return sorted(
        name
        for name, value in namespace.items()
        if not name.startswith("_") and _is_kind(value, kind)
    )


def _unknown_variable(
    expression: str, name: str | None, namespace: Mapping[str, Any], kind: str
) -> str:
    what, plural = KINDS[kind]
    text = f"no variable {name or expression!r} on the ranks"
    of_kind = _of_kind(namespace, kind)
    public = [n for n in namespace if not n.startswith("_")]
    hint = did_you_mean(name or expression, of_kind) or did_you_mean(name or expression, public)
    if hint:
        return f"{text}; {hint}"
    if of_kind:
        return f"{text}; the ranks' {plural}: {', '.join(of_kind)}"
    return f"{text}, and none holds {what}: define it in a %%fsdp cell (pool.run) first"


def _unknown_attribute(expression: str, error: AttributeError, kind: str) -> str:
    owner, name = getattr(error, "obj", None), getattr(error, "name", None)
    text = f"{expression!r} fails on the ranks: {error}"
    if owner is None or not name:
        return text
    attributes = [a for a in dir(owner) if not a.startswith("_")]
    of_kind = [a for a in attributes if _is_kind(_attribute(owner, a), kind)]
    hint = did_you_mean(name, of_kind) or did_you_mean(name, attributes)
    return f"{text}; {hint}" if hint else text


def _attribute(owner: Any, name: str) -> Any:
    """``owner.name``, or ``None`` where reading it fails (a property that raises)."""
    try:
        return getattr(owner, name)
    except Exception:
        return None
