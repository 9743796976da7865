"""What the pool installs in the IPython shell of each ipyparallel engine.

Engine side. Unlike :mod:`._bootstrap`, this module uses the engine's IPython
shell (every ipyparallel engine is an IPython kernel); nothing in ``fsdp``,
``inspect`` or ``checkpoint`` imports it, so ranks outside a pool never need IPython.

* :func:`join_pool`: start the diagnostics agent (:mod:`._agent`) with the key
  derived from the engine's session key (the cluster's HMAC key, which the kernel has
  too; it never travels), then join the group (:func:`._bootstrap.join_group`).
* :func:`pull`: a name of the engine's namespace, for ``Pool.pull``, with every tensor
  on the CPU (:mod:`._results`).
* :func:`mark_call` (called on the notebook side): the code of a notebook call with a
  first line naming the call (its journal entry) and, for a notebook cell, the cell's
  number, sent in the one execute request that carries the code. An input transformer
  that :func:`join_pool` installs in the engine's shell takes that line away before
  IPython compiles or numbers anything. While the code runs, the call's id is
  :func:`fsdp_interactive._notices.current_call` (a snapshot records it). Code of a cell
  runs as cell ``In[n]`` of the *notebook* (its tracebacks, the agent's stacks and the
  debugger say ``Cell In[n]``, the number the notebook shows, and line numbers are the
  cell's own); an exception it raises is kept for ``%fsdp debug`` (:mod:`._debugger`).
  Code without a cell number runs as the engine's own next cell, and its exceptions are
  not kept. Were the transformer missing, the line is a comment: the code still runs,
  one line lower.
* notices (:mod:`fsdp_interactive._notices`) go to the kernel over the agent's event link.
* ``tqdm.auto`` bars publish their states as displays of this shell, which the notebook
  draws (:mod:`._tqdm_auto`).
* IPython's ``%run`` fails the cell when the script raises (:func:`_make_run_magic_raise`).
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from typing import Any

from fsdp_interactive import _notices
from fsdp_interactive._text import call_label
from fsdp_interactive.pool.common import _agent_wire
from fsdp_interactive.pool.rank import (
    _agent,
    _bootstrap,
    _cell_watch,
    _debugger,
    _init_deferral,
    _results,
    _tqdm_auto,
)

_numbered: set[int] = set()
_next_is_notebook_cell = False
_hooked = False

_MARK_PREFIX = "# fsdp_interactive:"
_MARK_LINE = re.compile(r"# fsdp_interactive:((?: (?:call|cell|replay|noreplay)=\d+)+)\r?\n?\Z")


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


@dataclass(frozen=True)
class AgentSpec:
    """How a rank's diagnostics agent listens (:class:`._agent.RankAgent`)."""

    #: The address to bind, or the socket folder to listen in (a one-host pool).
    host: str
    #: Hex; with the engine's session key it makes the agent's key.
    nonce: str
    #: The agent ends this engine when the kernel that owns the pool is gone.
    end_with_owner: bool = False


def join_pool(spec: _bootstrap.JoinSpec, agent: AgentSpec) -> dict[str, Any]:
    """Start this engine's agent as ``agent`` says, then join the group as ``spec`` says.

    The record of :func:`._bootstrap.join_group` comes back with ``agent`` (``(host,
    port)``, or the path of a unix socket).
    """
    shell = _shell()
    key = _agent_wire.derive_key(bytes(shell.kernel.session.key), bytes.fromhex(agent.nonce))
    address = _agent.start(
        agent.host,
        key,
        user_thread=threading.get_ident(),
        code_name=code_name,
        rank=lambda: _bootstrap.rank_context()[0],
        end_with_owner=agent.end_with_owner,
    )
    _install_hooks(shell)
    _notices.set_sink(_notify_kernel)
    _notices.set_judge(_judge_names)
    _debugger.forget()
    record = _bootstrap.join_group(spec)
    record["agent"] = address
    return record


def user_namespace() -> dict[str, Any]:
    """This engine's user namespace: what the code of its cells sees as ``globals()``."""
    return _shell().user_global_ns


def pull(name: str) -> Any:
    """The value of ``name`` in this engine's namespace, with every tensor on the CPU
    (:func:`._results.pull_from`): what ``Pool.pull`` runs on each rank."""
    return _results.pull_from(user_namespace(), name)


def mark_call(
    code: str,
    call: int | None = None,
    cell: int | None = None,
    *,
    replaying: bool = False,
    replayed: int | None = None,
    kept_out: bool = False,
) -> str:
    """``code`` as an engine of the pool runs it: as notebook call ``call`` (a journal
    entry's id), as the notebook's cell ``cell``, and, with ``replaying`` (or ``replayed``,
    the id of the journal entry a recovery replays), as a call a recovery replays
    (:func:`fsdp_interactive._notices.replaying` is then true, and the entry's generators
    are set around it, :mod:`._cell_watch`); ``kept_out``: a call no recovery replays
    (``%%fsdp --no-replay``), so that a snapshot does not record a variable only it binds.

    Only a first line is added (none when there is nothing to mark); nothing in ``code``
    is changed or checked.
    """
    fields = [f"call={int(call)}"] if call is not None else []
    fields += [f"cell={int(cell)}"] if cell is not None else []
    if replayed is not None:
        fields += [f"replay={int(replayed)}"]
    elif replaying:
        fields += ["replay=0"]
    if kept_out and call is not None:
        fields += ["noreplay=1"]
    return f"{_MARK_PREFIX} {' '.join(fields)}\n{code}" if fields else code


def _notify_kernel(notice: dict[str, Any]) -> None:
    agent = _agent.current()
    if agent is not None:
        agent.notify(notice)


def _take_cell_mark(lines: list[str]) -> list[str]:
    """IPython input transformer (the first of the shell's cleanup transformers): a first
    line written by :func:`mark_call` is removed, the call it names becomes the current one
    and the cell being prepared is numbered.

    A transformer is the one public hook that IPython runs before it takes the execution
    count for the cell's name, its history and ``Out[n]``; the kernel transforms a cell
    once or twice before running it, and numbering the same cell again changes nothing.
    """
    global _next_is_notebook_cell
    mark = _MARK_LINE.match(lines[0]) if lines else None
    if mark is None:
        return lines
    fields = dict(item.split("=") for item in mark.group(1).split())
    _notices.set_current_call(
        int(fields["call"]) if "call" in fields else None, replaying="replay" in fields
    )
    replayed = int(fields.get("replay", "0"))
    _cell_watch.replaying_entry(replayed or None)
    call = int(fields["call"]) if "call" in fields else None
    cell = int(fields["cell"]) if "cell" in fields else None
    _cell_watch.next_call(call_label(call, cell, "".join(lines[1:])), "noreplay" in fields)
    if "cell" in fields:
        number = int(fields["cell"])
        _shell().execution_count = number
        _numbered.add(number)
        _next_is_notebook_cell = True
    return lines[1:]


def _install_hooks(shell: Any) -> None:
    global _hooked
    if not _hooked:
        shell.events.register("pre_run_cell", _before_cell)
        shell.events.register("post_run_cell", _after_cell)
        # First, so that IPython's own cleanup (leading blank lines, common indentation,
        # pasted prompts) sees the cell's code as the notebook has it.
        shell.input_transformers_cleanup.insert(0, _take_cell_mark)
        prepare_process()
        _make_run_magic_raise(shell)
        _hooked = True


def _make_run_magic_raise(shell: Any) -> None:
    """IPython's ``%run`` shows the exception a script raises and returns, so a cell that
    runs a failing script succeeds; on a rank the cell must fail (a failure the kernel never
    hears of leaves the ranks out of step). ``%run``'s runner becomes IPython's own
    ``safe_execfile`` with ``raise_exceptions=True`` (``sys.exit(0)`` still ends quietly)."""
    run = shell.magics_manager.magics["line"].get("run")
    magics = getattr(run, "__self__", None)  # IPython's ExecutionMagics instance
    if magics is not None and hasattr(magics, "default_runner"):
        magics.default_runner = functools.partial(_run_file_raising, shell)


def _run_file_raising(shell: Any, filename: str, *where: Any, exit_ignore: bool = False) -> None:
    __tracebackhide__ = True
    shell.safe_execfile(filename, *where, exit_ignore=exit_ignore, raise_exceptions=True)


def prepare_process() -> None:
    """Before any cell's imports: make ``tqdm.auto`` in this process give the rank bar,
    publishing through the shell of the engine it runs in when it draws, and wrap the
    parameter initialization functions (:func:`._init_deferral.install`). Again: nothing
    changes.

    The engine forker calls it before importing what cells import (warm imports): it has
    loaded ``ipykernel``, so ``tqdm.auto`` imported there would otherwise pick the notebook
    widget, and a module that binds its class at import (``from tqdm.auto import tqdm``:
    ``transformers``, ``tqdm.contrib``) would hand that widget to every engine forked after;
    a module that binds an initialization function by name binds the wrapper, as it does
    when a cell imports it in the first group.
    """
    _tqdm_auto.install(_publish_bar)
    _init_deferral.install()


def _publish_bar(data: dict[str, Any], display_id: str, update: bool) -> None:
    _shell().display_pub.publish(
        data=data, metadata={}, transient={"display_id": display_id}, update=update
    )


def _judge_names(name: str, value: Any, namespace: Any) -> str | None:
    """:func:`._cell_watch.judge` for the notebook's namespace; another (a script's
    globals) is not the journal's to judge."""
    if namespace is not _shell().user_ns:
        return None
    return _cell_watch.judge(name, value)


def _before_cell(info: Any) -> None:
    _cell_watch.before_cell(_shell().user_ns)


def _after_cell(result: Any) -> None:
    global _next_is_notebook_cell
    failed = getattr(result, "error_in_exec", None) is not None
    _cell_watch.after_cell(_shell().user_ns, failed=failed)
    _notices.set_current_call(None, replaying=False)
    if not _next_is_notebook_cell:
        return
    _next_is_notebook_cell = False
    error = getattr(result, "error_in_exec", None)
    if error is not None:
        _debugger.remember(error)
