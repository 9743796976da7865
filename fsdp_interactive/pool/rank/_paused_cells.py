"""Rank side: notebook cells run in a paused job's training thread, on the job's own names.

A job paused at a step boundary (:mod:`._job_pause`) runs each cell the notebook sends in
its training thread, where its model, optimizer and process group live. What a cell sees
(:class:`CellNamespace`): the script's ``__main__`` globals, over them the locals of the
paused frame (the training loop that called ``optimizer.step()``), over those the names
earlier cells defined. Each cell runs in one fresh dict holding all three (so functions
and comprehensions a cell defines see them too); afterwards the names the cell bound,
rebound or deleted are kept as the cells' own. A cell therefore never rebinds a name of
the job (``lr = 0.1`` makes a cell variable ``lr``; the job's ``lr`` is untouched), while
it can change the objects the job holds (``model.weight.data.mul_(0)``: the job computes
with that afterwards). The cells' names go when the job resumes.

:func:`run_cell` executes like a notebook cell: the value of a last expression comes
back as its ``repr``, what the training thread prints while the cell runs is captured (other
threads keep printing where they did), an exception comes back as its traceback from the
cell's frame on. Cell code is named ``<cell In[N]>`` (``Cell In[N]`` in stacks and
tracebacks, as the notebook numbers it) and its lines are kept in :mod:`linecache`.
"""

from __future__ import annotations

import ast
import io
import linecache
import sys
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

_CELL_FILE = "<cell In[{}]>"


def code_name(filename: str) -> str | None:
    """``"Cell In[5]"`` for the code of a cell run here, else ``None``."""
    if filename.startswith("<cell In[") and filename.endswith("]>"):
        return filename[1:-1].replace("cell", "Cell", 1)
    return None


class CellNamespace:
    """What cells see while a rank is paused (see the module)."""

    def __init__(self, main_globals: Mapping[str, Any], frame: FrameType | None) -> None:
        self._main = main_globals
        # A stopped frame's locals do not change while it is stopped: read them once.
        self._frame_locals = dict(frame.f_locals) if frame is not None else {}
        self.defined: dict[str, Any] = {}

    def fresh(self) -> dict[str, Any]:
        """A dict with every name a cell sees, to run one cell in."""
        return {**self._main, **self._frame_locals, **self.defined}

    def keep(self, before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
        """Keep what a cell that ran in ``after`` (made from ``before``) bound or deleted."""
        for name, value in after.items():
            if name not in before or before[name] is not value:
                self.defined[name] = value
        for name in before:
            if name not in after:
                self.defined.pop(name, None)

    def lookup(self, name: str) -> Any:
        """The value a cell would see under ``name``; ``KeyError`` when there is none."""
        for scope in (self.defined, self._frame_locals, self._main):
            if name in scope:
                return scope[name]
        raise KeyError(name)


@dataclass
class CellOutcome:
    """What one cell did on this rank: its output, the ``repr`` of its last expression
    (``None``: it ended with a statement) and, if it raised, ``error`` = (type name,
    message) and ``traceback`` (text, from the cell's frame on)."""

    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: tuple[str, str] | None = None
    traceback: str | None = None
    data: dict[str, str] = field(default_factory=dict)


class _ThreadStream(io.TextIOBase):
    """A stream that keeps what one thread writes and passes other threads' writes on."""

    def __init__(self, thread: int, passed: TextIO) -> None:
        self._thread = thread
        self._passed = passed
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        if threading.get_ident() == self._thread:
            return self.kept.write(text)
        return self._passed.write(text)

    def flush(self) -> None:
        if threading.get_ident() != self._thread:
            self._passed.flush()

    def writable(self) -> bool:
        return True


def run_cell(code: str, cell: int, namespace: CellNamespace) -> CellOutcome:
    """Run ``code`` as cell ``cell`` in ``namespace`` in the calling thread (see the module)."""
    filename = _CELL_FILE.format(cell)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    outcome = CellOutcome()
    out = _ThreadStream(threading.get_ident(), sys.stdout)
    err = _ThreadStream(threading.get_ident(), sys.stderr)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    scope = namespace.fresh()
    before = dict(scope)
    try:
        body, last = _split(code, filename)
        exec(body, scope)
        if last is not None:
            value = eval(last, scope)
            if value is not None:
                outcome.result = repr(value)
                outcome.data = {"text/plain": outcome.result}
    except BaseException as error:  # a cell's error, KeyboardInterrupt included, is reported
        outcome.error = (type(error).__name__, str(error))
        tb = error.__traceback__
        outcome.traceback = "".join(
            traceback.format_exception(type(error), error, tb.tb_next if tb else None)
        )
    finally:
        sys.stdout, sys.stderr = saved
        namespace.keep(before, scope)
    outcome.stdout, outcome.stderr = out.kept.getvalue(), err.kept.getvalue()
    return outcome


def _split(code: str, filename: str) -> tuple[Any, Any]:
    """The cell compiled as (statements, last expression or ``None``)."""
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, filename, "exec")
    return body, (compile(last, filename, "eval") if last is not None else None)
