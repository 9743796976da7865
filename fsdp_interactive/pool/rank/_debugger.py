"""Rank side: pdb on a rank, driven from the notebook without a terminal.

Two ways in, both free of IPython (the engine's shell is reached through the hooks of
:mod:`._engine_shell`):

* **Post-mortem**: :func:`remember` keeps the last exception a notebook cell raised on
  this rank; :func:`post_mortem` runs one pdb command (``p x``, ``up``, ``where``, ...)
  in a session on its traceback and returns the output. The session lives on between
  calls, as a pdb session does (``up`` stays up), until ``q`` (or ``c``) ends it or a
  newer failure replaces it. It runs on the diagnostics agent's thread
  (:mod:`._agent`), so it works while the rank is busy with another cell.
* **Live**: :class:`LivePdb`, the debugger behind :func:`._breakpoint.breakpoint`,
  which inside a cell stops rank ``rank`` at the next line while
  the other ranks wait; as soon as the stopped rank runs on (``c``, ``n``, ``s``, ...)
  the others are released too (they meet it again at the next collective). Commands
  come from the notebook over the agent's event link (the kernel's waiting loop asks
  the user through ``input()``, i.e. the notebook's input box), or from ``commands=``
  (for notebooks run unattended: the transcript goes to the rank's stderr, and the
  debugger continues after the last command).

Not done: breakpoints on several ranks at once, or tracing threads other than the
cell's (pdb is per thread).
"""

from __future__ import annotations

import io
import pdb
import sys
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from fsdp_interactive.pool.common._stacks import is_cell_file, is_machinery
from fsdp_interactive.pool.rank._thread_stacks import CodeName

_lock = threading.Lock()
_failure: BaseException | None = None
_session: _PostMortem | None = None


class _CellNamedPdb(pdb.Pdb):
    """pdb that names notebook cell code as the notebook does ("Cell In[15](3)<module>()")."""

    code_name: CodeName | None = None

    def get_stack(self, f: Any, t: Any) -> tuple[list[Any], int]:
        """pdb's stack without the engine's frames outside the cell (``where`` starts at
        the cell)."""
        stack, index = super().get_stack(f, t)
        first = next(
            (i for i, (frame, _) in enumerate(stack) if is_cell_file(frame.f_code.co_filename)),
            0,
        )
        first = min(first, index)
        return stack[first:], index - first

    def format_stack_entry(self, frame_lineno: Any, lprefix: str = ": ") -> str:
        text = super().format_stack_entry(frame_lineno, lprefix)
        filename = frame_lineno[0].f_code.co_filename
        label = self.code_name(filename) if self.code_name is not None else None
        return text.replace(self.canonic(filename), label, 1) if label else text


class _CapturedPdb(_CellNamedPdb):
    """pdb that writes into a buffer and never touches signals or rc files."""

    def __init__(self, prompt: str, code_name: CodeName | None) -> None:
        super().__init__(stdin=io.StringIO(), stdout=_Buffer(), readrc=False, nosigint=True)
        self.prompt = prompt
        self.use_rawinput = False
        self.code_name = code_name

    def take_output(self) -> str:
        return self.stdout.take()  # type: ignore[attr-defined]


class _Buffer(io.StringIO):
    def take(self) -> str:
        text = self.getvalue()
        self.seek(0)
        self.truncate()
        return text


# ---------------------------------------------------------------------- post-mortem


class _PostMortem:
    """A pdb session on one exception's traceback (user frames only)."""

    def __init__(self, error: BaseException, code_name: CodeName | None) -> None:
        self.error = error
        self.pdb = _CapturedPdb("(Pdb) ", code_name)
        tb = _user_traceback(error.__traceback__)
        self.pdb.reset()
        self.pdb.setup(None, tb)
        self.active = True

    def intro(self) -> str:
        self.pdb.message(f"{type(self.error).__name__}: {self.error}")
        self.pdb.print_stack_entry(self.pdb.stack[self.pdb.curindex])
        return self.pdb.take_output()

    def run(self, command: str) -> str:
        self.pdb.cmdqueue.append(command)
        while self.pdb.cmdqueue and self.active:
            line = self.pdb.precmd(self.pdb.cmdqueue.pop(0))
            stop = self.pdb.postcmd(self.pdb.onecmd(line), line)
            if stop:
                self.active = False
                self.pdb.message("(the post-mortem session ended; %fsdp debug starts a new one)")
        return self.pdb.take_output()


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the engine's frames that ran the cell (IPython's ``run_code``)."""
    while (
        tb is not None and tb.tb_next is not None and is_machinery(tb.tb_frame.f_code.co_filename)
    ):
        tb = tb.tb_next
    return tb


def remember(error: BaseException) -> None:
    """Keep ``error`` as this rank's last failure; a session on an older one ends."""
    global _failure, _session
    with _lock:
        _failure = error
        _session = None


def forget() -> None:
    global _failure, _session
    with _lock:
        _failure = None
        _session = None


def post_mortem(command: str | None, code_name: CodeName | None = None) -> dict[str, Any]:
    """Run ``command`` in the post-mortem session of this rank's last failure.

    ``command=None`` starts the session (or shows where an open one stands). Returns
    ``{"output": text, "active": whether the session is still open, "failure": the
    exception line}``, or ``{"output": "", "active": False, "failure": None}`` when this
    rank has no failure to look at.
    """
    global _session
    with _lock:
        if _failure is None:
            return {"output": "", "active": False, "failure": None}
        output = ""
        if _session is None or not _session.active:
            _session = _PostMortem(_failure, code_name)
            output = _session.intro()
        elif command is None:
            _session.pdb.print_stack_entry(_session.pdb.stack[_session.pdb.curindex])
            output = _session.pdb.take_output()
        if command is not None:
            output += _session.run(command)
        return {
            "output": output,
            "active": _session.active,
            "failure": f"{type(_failure).__name__}: {_failure}",
        }


# ---------------------------------------------------------------------- live


#: Modules the live debugger never stops in: the engine that runs the cell, and this one.
_SKIPPED = (
    "IPython.*",
    "ipykernel.*",
    "ipyparallel.*",
    "tornado.*",
    "asyncio.*",
    "zmq.*",
    "traitlets.*",
    "fsdp_interactive.pool.*",
)


class LivePdb(_CellNamedPdb):
    """pdb stopped in a cell on one rank; prompts go to ``ask(text) -> command``.

    IPython runs each top-level statement of a cell as its own code object, so stepping
    past the end of one leads into the next (the engine's frames in between are
    skipped), and the end of the cell's last statement ends the session: the debugger
    never stops in the engine's own code after the cell.
    """

    def __init__(
        self, rank: int, ask: Any, show: Any, release: Any, code_name: CodeName | None
    ) -> None:
        super().__init__(
            stdin=_PromptReader(self),
            stdout=_Buffer(),
            readrc=False,
            nosigint=True,
            skip=_SKIPPED,
        )
        self.prompt = f"(rank {rank} Pdb) "
        self.use_rawinput = False
        self.code_name = code_name
        self._ask = ask
        self._show = show
        self._release = release
        self._stopped = False

    def interaction(self, frame: Any, tb: Any) -> None:
        self._stopped = True
        super().interaction(frame, tb)

    def stop_here(self, frame: Any) -> bool:
        # Never in the engine's own code, even code not in a skipped module.
        return _under_cell(frame) and super().stop_here(frame)

    def user_call(self, frame: Any, argument_list: Any) -> None:
        if _cell_chunk(frame):
            return  # entering the cell's next statement: stop at its first line instead
        super().user_call(frame, argument_list)

    def user_return(self, frame: Any, return_value: Any) -> None:
        if _cell_chunk(frame):
            if _last_statement(frame):
                self.message("(end of the cell: the rank runs on)")
                self._show(self.stdout.take())  # type: ignore[attr-defined]
                self._release()  # also when it never stopped (a breakpoint on the last line)
                self.set_continue()
            return  # the cell's next statement comes in a fresh code object
        super().user_return(frame, return_value)

    def _run_on(self) -> None:
        if self._stopped:
            self._release()

    # Every way of leaving the prompt lets the other ranks go too.
    def set_step(self) -> None:
        self._run_on()
        super().set_step()

    def set_next(self, frame: Any) -> None:
        self._run_on()
        super().set_next(frame)

    def set_return(self, frame: Any) -> None:
        self._run_on()
        super().set_return(frame)

    def set_until(self, frame: Any, lineno: int | None = None) -> None:
        self._run_on()
        super().set_until(frame, lineno)

    def set_continue(self) -> None:
        self._run_on()
        super().set_continue()

    def set_quit(self) -> None:
        self._run_on()
        super().set_quit()


class _PromptReader:
    """pdb's stdin: each ``readline`` hands what pdb printed (ending with its prompt) to
    the debugger's ``ask`` and returns the command it gets back."""

    def __init__(self, debugger: LivePdb) -> None:
        self._debugger = debugger

    def readline(self) -> str:
        debugger = self._debugger
        text = debugger.stdout.take()  # type: ignore[attr-defined]
        try:
            command = debugger._ask(text)
        except BaseException:
            debugger._release()
            raise
        return command + "\n"


def _cell_chunk(frame: Any) -> bool:
    """Whether ``frame`` runs one top-level statement of a cell (IPython's code object)."""
    return frame.f_code.co_name == "<module>" and is_cell_file(frame.f_code.co_filename)


def _under_cell(frame: Any) -> bool:
    """Whether ``frame`` runs cell code or was called (however deeply) from cell code."""
    while frame is not None:
        if is_cell_file(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def _last_statement(frame: Any) -> bool:
    """Whether the cell chunk ``frame`` runs is the cell's last top-level statement."""
    import ast
    import linecache

    source = "".join(linecache.getlines(frame.f_code.co_filename))
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    # A module code object's co_firstlineno is 1 whatever it holds: read its lines.
    lines = [line for _, _, line in frame.f_code.co_lines() if line]
    return bool(body) and max(lines, default=0) >= body[-1].lineno


def kernel_io(rank: int, link: Any) -> tuple[Any, Any]:
    """``(ask, show)`` for a notebook: prompts and output go over the event link; ``ask``
    waits for the command the user typed."""
    prompt = f"(rank {rank} Pdb) "

    def ask(text: str) -> str:
        output = text[: -len(prompt)] if text.endswith(prompt) else text
        link.send({"kind": "prompt", "rank": rank, "output": output, "prompt": prompt})
        reply = link.recv()
        return str(reply.get("command", "continue"))

    def show(text: str) -> None:
        if text:
            link.send({"kind": "output", "rank": rank, "output": text})

    return ask, show


def scripted_io(commands: Sequence[str]) -> tuple[Any, Any]:
    """``(ask, show)`` for ``commands=``: the transcript goes to stderr; after the last
    command the debugger continues."""
    queue = list(commands)

    def show(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    def ask(text: str) -> str:
        command = queue.pop(0) if queue else "continue"
        show(f"{text}{command}\n")
        return command

    return ask, show
