"""What the pool installs in the IPython shell of each ipyparallel engine.

Engine side. Unlike :mod:`._rank_bootstrap`, this module uses the engine's IPython
shell (every ipyparallel engine is an IPython kernel); nothing in ``fsdp``,
``inspect`` or ``checkpoint`` imports it, so ranks outside a pool never need IPython.

* :func:`join_pool`: start the diagnostics agent (:mod:`._rank_agent`) with the key
  derived from the engine's session key (the cluster's HMAC key, which the kernel has
  too; it never travels), then join the group (:func:`._rank_bootstrap.join_group`).
* :func:`number_cell`: sent just before a notebook cell's code, on the same queue:
  the engine runs that code as cell ``In[n]`` of the *notebook* (its tracebacks, the
  agent's stacks and the debugger say ``Cell In[n]``, the number the notebook shows),
  and an exception it raises is kept for ``%fsdp debug`` (:mod:`._rank_debugger`).
"""

from __future__ import annotations

import threading
from typing import Any

from fsdp_interactive.pool import _agent_wire, _rank_agent, _rank_bootstrap, _rank_debugger

_numbered: set[int] = set()
_next_is_notebook_cell = False
_hooked = False


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


def number_cell(number: int) -> None:
    """The next code this engine runs is the notebook's cell ``number``."""
    global _next_is_notebook_cell
    shell = _shell()
    shell.execution_count = int(number)
    _numbered.add(int(number))
    _next_is_notebook_cell = True


def _install_hooks(shell: Any) -> None:
    global _hooked
    if not _hooked:
        shell.events.register("post_run_cell", _after_cell)
        _hooked = True


def _after_cell(result: Any) -> None:
    global _next_is_notebook_cell
    if not _next_is_notebook_cell:
        return
    _next_is_notebook_cell = False
    error = getattr(result, "error_in_exec", None)
    if error is not None:
        _rank_debugger.remember(error)
