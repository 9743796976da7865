"""What the pool installs in the IPython shell of each ipyparallel engine.

Engine side. Unlike :mod:`._rank_bootstrap`, this module uses the engine's IPython
shell (every ipyparallel engine is an IPython kernel); nothing in ``fsdp``,
``inspect`` or ``checkpoint`` imports it, so ranks outside a pool never need IPython.

* :func:`join_pool`: start the diagnostics agent (:mod:`._rank_agent`) with the key
  derived from the engine's session key (the cluster's HMAC key, which the kernel has
  too; it never travels), then join the group (:func:`._rank_bootstrap.join_group`).
* :func:`mark_cell` (called on the notebook side): the code of a notebook cell with a
  first line naming its number, sent in the one execute request that carries the code.
  An input transformer that :func:`join_pool` installs in the engine's shell takes
  that line away before IPython compiles or numbers anything, and the engine runs the
  rest as cell ``In[n]`` of the *notebook* (its tracebacks, the agent's stacks and
  the debugger say ``Cell In[n]``, the number the notebook shows, and line numbers
  are the cell's own); an exception it raises is kept for ``%fsdp debug``
  (:mod:`._rank_debugger`). Code without that first line runs as the engine's own
  next cell, and its exceptions are not kept. Were the transformer missing, the line
  is a comment: the code still runs, one line lower.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from fsdp_interactive.pool import _agent_wire, _rank_agent, _rank_bootstrap, _rank_debugger

_numbered: set[int] = set()
_next_is_notebook_cell = False
_hooked = False

_MARK = "# fsdp_interactive: notebook cell In[{number}]\n"
_MARK_LINE = re.compile(r"# fsdp_interactive: notebook cell In\[(\d+)\]\r?\n?\Z")


def _shell() -> Any:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("not running inside an IPython engine")
    return shell


def code_name(filename: str) -> str | None:
    """``"Cell In[15]"`` for the code of notebook cell 15, else ``None``."""
    try:
        named = _shell().compile.format_code_name(filename)
    except Exception:
        return None
    if not named:
        return None
    label, name = named
    number = name[3:-1] if name.startswith("In[") and name.endswith("]") else None
    if number is None or not number.isdigit() or int(number) not in _numbered:
        return None
    return f"{label} {name}"


def join_pool(spec: dict[str, Any]) -> dict[str, Any]:
    """Start this engine's agent, then join the group as ``spec`` says.

    ``spec["agent"]``: ``{"host": address to bind, "nonce": hex, "end_with_owner":
    bool}`` (see :class:`._rank_agent.RankAgent`). The record of
    :func:`._rank_bootstrap.join_group` comes back with ``agent`` (``[host, port]``).
    """
    shell = _shell()
    agent = spec["agent"]
    key = _agent_wire.derive_key(bytes(shell.kernel.session.key), bytes.fromhex(agent["nonce"]))
    address = _rank_agent.start(
        agent["host"],
        key,
        user_thread=threading.get_ident(),
        code_name=code_name,
        rank=lambda: _rank_bootstrap.rank_context()[0],
        end_with_owner=bool(agent.get("end_with_owner")),
    )
    _install_hooks(shell)
    _rank_debugger.forget()
    record = _rank_bootstrap.join_group(spec)
    record["agent"] = list(address)
    return record


def mark_cell(code: str, number: int) -> str:
    """``code`` as an engine of the pool runs it as the notebook's cell ``number``.

    Only the first line is added; nothing in ``code`` is changed or checked.
    """
    return _MARK.format(number=int(number)) + code


def _take_cell_mark(lines: list[str]) -> list[str]:
    """IPython input transformer (the first of the shell's cleanup transformers): a first
    line written by :func:`mark_cell` is removed, and the cell being prepared is numbered.

    A transformer is the one public hook that IPython runs before it takes the execution
    count for the cell's name, its history and ``Out[n]``; the kernel transforms a cell
    once or twice before running it, and numbering the same cell again changes nothing.
    """
    global _next_is_notebook_cell
    mark = _MARK_LINE.match(lines[0]) if lines else None
    if mark is None:
        return lines
    number = int(mark.group(1))
    _shell().execution_count = number
    _numbered.add(number)
    _next_is_notebook_cell = True
    return lines[1:]


def _install_hooks(shell: Any) -> None:
    global _hooked
    if not _hooked:
        shell.events.register("post_run_cell", _after_cell)
        # First, so that IPython's own cleanup (leading blank lines, common indentation,
        # pasted prompts) sees the cell's code as the notebook has it.
        shell.input_transformers_cleanup.insert(0, _take_cell_mark)
        _hooked = True


def _after_cell(result: Any) -> None:
    global _next_is_notebook_cell
    if not _next_is_notebook_cell:
        return
    _next_is_notebook_cell = False
    error = getattr(result, "error_in_exec", None)
    if error is not None:
        _rank_debugger.remember(error)
