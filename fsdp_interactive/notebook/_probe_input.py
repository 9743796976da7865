"""A probe's or view's input that the caller got wrong, said in the kernel (notebook side).

The probes run on the ranks; an argument they cannot take (a parameter name the model does
not have, a module where a parameter is edited, a rank-side variable that does not exist
or holds the wrong kind of value) fails there. Such a failure is the caller's to fix, not
something to debug on a rank: :func:`input_error` turns a ``RankError`` whose every rank
raised one of the rank-side input errors (:class:`fsdp_interactive.wrapping.UnknownName`,
:class:`fsdp_interactive.inspect.ProbeInputError`) into a short :class:`ProbeInputError`
raised in the kernel, naming the call and the close matches the rank found, without the
rank's traceback or the debugger's advice. Arguments the kernel can check itself (a norm
type) are checked here before anything runs.
"""

from __future__ import annotations

import math
from typing import Any

#: Rank-side exception classes (by name, as a rank's error reports them) that mark an
#: error of the caller's input.
RANK_INPUT_ERRORS = frozenset({"UnknownName", "ProbeInputError"})


class ProbeInputError(ValueError):
    """A probe or view was given something the ranks do not have or cannot take; the
    message names the call, what is wrong and, where there are some, the close matches."""


class UnknownNameError(ProbeInputError, KeyError):
    """A parameter or module name the model on the ranks does not have (also a
    ``KeyError``), shown without ``KeyError``'s quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def input_error(error: Any, call: str | None) -> ProbeInputError | None:
    """The kernel's error for ``error`` (a ``RankError``) when every failing rank raised
    an input error; ``None`` otherwise. ``call``: how the caller wrote the call
    (``"RankModel.summon('x')"``), put before the rank's message."""
    errors = getattr(error, "errors", None) or {}
    if not errors or not all(name in RANK_INPUT_ERRORS for name, _ in errors.values()):
        return None
    name, message = errors[min(errors)]
    text = f"{call}: {message}" if call else message
    return UnknownNameError(text) if name == "UnknownName" else ProbeInputError(text)


def norm_type_literal(norm_type: Any, call: str) -> str:
    """``norm_type`` as Python source the ranks evaluate (``float('inf')`` for infinity,
    whose ``repr`` is no Python literal); :class:`ProbeInputError` naming ``call`` unless it
    is a number > 0 or infinity."""
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(norm_type, bool) or not (value > 0):
        raise ProbeInputError(
            f"{call}: norm_type must be a number > 0 or float('inf'), got {norm_type!r}"
        )
    return "float('inf')" if math.isinf(value) else repr(value)
