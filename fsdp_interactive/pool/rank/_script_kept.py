"""Rank side: what a script run built, kept for the cells after it.

A script's objects live mostly in the local variables of its functions (``main()``'s
``model``, ``optimizer``, ``trainer``), which are gone once the function returns. To keep
them, :func:`compile_script` compiles the script's source with one change that the
script cannot see: the body of each of its functions runs inside ``try: ... finally:``
whose ``finally`` calls a hook (:data:`RETURN_HOOK`, a global of the script's module),
and the hook keeps the locals of a call made from the script's top level (``main()``
called under ``if __name__ == "__main__"``) as the call ends, by return or by exception.
Line numbers, tracebacks and ``__doc__`` stay the script's; the cost is one hook call per
function return.

:func:`built_names` then gives the names a run leaves to the cells, whatever way it
ended: its module's globals, then the locals of its frames, outermost first (an inner
frame's name wins): the frames alive at a pause, the frames of a traceback, or the
top-level calls kept by the hook after a normal end. :func:`summary` describes a value in
a few words (type and, for tensors, shape and dtype; for numbers and short strings, the
value) for the kernel's one-line listing.

Free of IPython; nothing here touches torch beyond reading attributes of values.
"""

from __future__ import annotations

import ast
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

#: The global through which the compiled functions report their end (never shown).
RETURN_HOOK = "_fsdp_interactive_returned"


class _KeepLocals(ast.NodeTransformer):
    """Every function body becomes ``try: <body> finally: RETURN_HOOK()`` (a docstring
    stays the first statement)."""

    def _wrap(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        self.generic_visit(node)
        body = list(node.body)
        doc: list[ast.stmt] = []
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            doc, body = body[:1], body[1:]
        if not body:
            return node
        call = ast.Expr(ast.Call(ast.Name(RETURN_HOOK, ast.Load()), [], []))
        last = body[-1]
        ast.copy_location(call, last)
        call.lineno = call.end_lineno = getattr(last, "end_lineno", last.lineno) or last.lineno
        wrapped = ast.Try(body=body, handlers=[], orelse=[], finalbody=[call])
        ast.copy_location(wrapped, body[0])
        node.body = [*doc, wrapped]
        return node

    visit_FunctionDef = _wrap  # type: ignore[assignment]
    visit_AsyncFunctionDef = _wrap  # type: ignore[assignment]


def compile_script(source: str, filename: str) -> types.CodeType:
    """``source`` compiled as the module ``filename`` with the return hook (module
    docstring); ``SyntaxError`` as Python gives it for the script itself."""
    tree = ast.parse(source, filename, "exec")
    tree = ast.fix_missing_locations(_KeepLocals().visit(tree))
    return compile(tree, filename, "exec", dont_inherit=True)


class KeptCalls:
    """The locals of the script's top-level calls, as each ended (the return hook)."""

    def __init__(self, module_code: types.CodeType) -> None:
        self._module_code = module_code
        self.calls: list[dict[str, Any]] = []

    def hook(self) -> None:
        """:data:`RETURN_HOOK`: runs in the ``finally`` of every function of the script."""
        try:
            frame = sys._getframe(1)
            caller = frame.f_back
            if caller is not None and caller.f_code is self._module_code:
                self.calls.append(dict(frame.f_locals))
        except Exception:  # never fail the script for what the pool keeps
            return


def script_frames(frame: types.FrameType | None, filename: str) -> list[types.FrameType]:
    """The frames of the script's own code from ``frame`` outwards, outermost first."""
    found = []
    while frame is not None:
        if frame.f_code.co_filename == filename:
            found.append(frame)
        frame = frame.f_back
    return found[::-1]


def traceback_frames(tb: types.TracebackType | None, filename: str) -> list[types.FrameType]:
    """The frames of the script's own code in a traceback, outermost first."""
    found = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            found.append(tb.tb_frame)
        tb = tb.tb_next
    return found


def public(names: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """The names a run leaves to the cells: not ``_private``, not the hook."""
    for name, value in list(names.items()):
        if isinstance(name, str) and name.isidentifier() and not name.startswith("_"):
            yield name, value


def built_names(
    module: Mapping[str, Any],
    frames: list[types.FrameType] | None = None,
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The module's globals, then the locals of ``frames`` (outermost first, the
    ``<module>`` frame skipped: its locals are the globals) and of the kept top-level
    ``calls``; a later name wins."""
    names = dict(public(module))
    for local in calls or []:
        names.update(public(local))
    for frame in frames or []:
        if frame.f_code.co_name != "<module>":
            names.update(public(frame.f_locals))
    return names


def is_definition(value: Any) -> bool:
    """A module, function or class: listed by count, not one by one."""
    return isinstance(
        value, types.ModuleType | types.FunctionType | type | types.BuiltinFunctionType
    )


def summary(value: Any, width: int = 40) -> str:
    """``FullyShardedDataParallel``, ``Tensor (4, 8) float32``, ``int 5``, ``str 'adam'``."""
    kind = type(value).__name__
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        dims = tuple(int(d) for d in value.shape)
        return f"{kind} {dims} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, bool | int | float | complex | str | bytes) or value is None:
        text = repr(value)
        return f"{kind} {text if len(text) <= width else text[: width - 3] + '...'}"
    if isinstance(value, list | tuple | dict | set):
        return f"{kind} ({len(value)} items)"
    return kind
