"""How one journal entry (or one push) of a notebook session becomes part of an exported
script, or why it cannot (kernel side, read from the journal; nothing runs).

:func:`carry` takes an entry in the order the export writes it, with the names the
script has defined before it (:class:`Names`), and gives a :class:`Piece`: the script's
text for it, or the reason it cannot be carried:

* a ``%%fsdp`` cell: its code as it ran, at the script's top level (its names are the
  script's globals, as they were the namespace's); on part of the ranks, inside ``if
  rank in (...)``;
* ``%fsdp snapshot`` (or the Snapshots panel): a plain ``fsdp_interactive.snapshot(...)``;
* a push (``%fsdp push``, ``Pool.push``): the values read from the export's values file;
* ``%fsdp run`` / ``%fsdp continue``: the job's :func:`~.rank._job.run_script` /
  :func:`~.rank._job.continue_script`, which run the script as the pool did, to the same
  pauses.

What it cannot carry, each with its reason: a cell that also ran in the kernel
(``--local``), IPython syntax (``%magic``, ``!shell``), widgets and displays (a job has
no notebook to show them), a read of a name that no earlier part of the script defines
(a value that reached the ranks outside the journal: never pushed, set by a call the
journal does not keep, or by a cell that failed), a pushed value that cannot be written
safely (only numbers, strings, containers of them and tensors can), code on part of the
ranks holding a string that spans lines (indenting it would change it).
"""

from __future__ import annotations

import ast
import builtins
import io
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive.pool._cell_imports import parse
from fsdp_interactive.pool._journal import JournalEntry, Push
from fsdp_interactive.pool._script_record import ScriptRecord

#: What every ``%%fsdp`` cell found in its namespace (the pool pre-fills it), and what
#: the exported script's first lines define the same way.
PREFILLED = frozenset({"torch", "dist", "rank", "world_size", "local_rank", "device"})
#: What shows widgets or displays: a job has no notebook to show them in.
_DISPLAY_MODULES = ("ipywidgets", "IPython")
_DISPLAY_CALLS = frozenset({"display", "get_ipython"})
_SNAPSHOT_SCRATCH = "_fsdp_interactive_snapshot"


@dataclass(frozen=True)
class Piece:
    """One part of the exported script: ``label`` (``In[3]``, ``push lr``), ``code`` (its
    text in the script; empty when not carried), ``why``: what it is, or why it cannot be
    carried (``carried`` False)."""

    label: str
    code: str
    why: str
    carried: bool = True


@dataclass
class Names:
    """The names the script defines before the part being written."""

    defined: set[str] = field(default_factory=lambda: set(PREFILLED) | set(dir(builtins)))

    def missing(self, names: frozenset[str] | set[str]) -> list[str]:
        return sorted(n for n in names if n not in self.defined)


def carry_entry(entry: JournalEntry, names: Names) -> Piece:
    """The script's text for ``entry``, or why it cannot be carried (module docstring);
    ``names`` gets what it defines."""
    label = entry.label
    if "local" in entry.marks:
        return Piece(
            label,
            "",
            "it also ran in the kernel (%%fsdp --local): what it did there has no place in a "
            "rank's script",
            False,
        )
    if isinstance(entry.script, ScriptRecord):
        names.defined.update(entry.rebound)
        return Piece(label, _script_call(entry), _script_what(entry.script))
    snapshot = _snapshot_call(entry.source)
    if snapshot is not None:
        return Piece(label, snapshot, f"a snapshot ({entry.shown or 'fsdp_interactive.snapshot'})")
    refusal = _refusal(entry, names)
    if refusal is not None:
        return Piece(label, "", refusal, False)
    fx = entry.effects
    names.defined.update(fx.defines, entry.rebound)
    code = entry.source.rstrip("\n")
    if entry.targets is not None:
        if _multiline_strings(code):
            return Piece(
                label,
                "",
                f"it ran on ranks {entry.targets} only and holds a string of several lines, "
                "which indenting it under `if rank in ...` would change",
                False,
            )
        body = "\n".join(("    " + line) if line.strip() else "" for line in code.splitlines())
        code = f"if rank in {tuple(entry.targets)!r}:\n{body}"
    return Piece(label, code, "training cell" if "train" in entry.marks else "cell")


def carry_push(push: Push, label: str, names: Names, key: str) -> tuple[Piece, dict[str, Any]]:
    """The script's lines for a push (the values read from the values file under ``key``)
    and the values to write there; a refusal names each value that cannot be written."""
    bad = {name: why for name, value in push.values.items() if (why := unsafe(value))}
    if bad:
        reasons = "; ".join(f"{name} ({why})" for name, why in bad.items())
        return Piece(
            label,
            "",
            f"pushed values that cannot be written safely: {reasons}; only numbers, strings, "
            "bytes, None, lists, tuples, dicts with string keys and tensors can be",
            False,
        ), {}
    lines = [f"{name} = _values['pushes'][{key!r}][{name!r}]" for name in push.values]
    code = "\n".join(lines)
    if push.targets is not None:
        code = f"if rank in {tuple(push.targets)!r}:\n" + "\n".join("    " + ln for ln in lines)
    names.defined.update(push.values)
    return Piece(label, code, f"values pushed from the kernel: {', '.join(push.values)}"), dict(
        push.values
    )


def unsafe(value: Any, depth: int = 0) -> str | None:
    """Why ``value`` cannot go in the values file (``None``: it can), which holds plain
    data and plain tensors only (:func:`~.rank._job.encode`)."""
    if depth > 20:
        return "nested too deep"
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return None
    if isinstance(value, list | tuple):
        return next((why for item in value if (why := unsafe(item, depth + 1))), None)
    if isinstance(value, dict):
        if not all(isinstance(key, str | int) for key in value):
            return "a dict whose keys are not strings"
        return next((why for item in value.values() if (why := unsafe(item, depth + 1))), None)
    if _is_plain_tensor(value):
        return None
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def _is_plain_tensor(value: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return False
    return type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter)


def _refusal(entry: JournalEntry, names: Names) -> str | None:
    try:
        tree = ast.parse(entry.source)
    except (SyntaxError, ValueError):
        if parse(entry.source) is not None:
            magic = next(
                line.strip()
                for line in entry.source.splitlines()
                if line.lstrip().startswith(("%", "!"))
            )
            return f"it uses IPython syntax ({magic}), which a Python script cannot run"
        return "its code does not parse as Python"
    shown = _displays(tree)
    if shown:
        return f"it shows widgets or displays ({shown}): a torchrun job has no notebook for them"
    missing = names.missing(entry.effects.reads_now)
    if missing:
        return (
            f"it reads {', '.join(missing)}, which nothing exported before it defines: a value "
            "that reached the ranks outside the journal (never pushed, or set by a call or a "
            "cell that failed)"
        )
    return None


def _displays(tree: ast.AST) -> str | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for module in modules:
                if module.split(".")[0] in _DISPLAY_MODULES:
                    return f"import {module}"
        called = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if called and node.func.id in _DISPLAY_CALLS:
            return f"{node.func.id}(...)"
    return None


def _multiline_strings(code: str) -> bool:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return True
    return any(t.type == tokenize.STRING and t.start[0] != t.end[0] for t in tokens)


def _snapshot_call(source: str) -> str | None:
    """``fsdp_interactive.snapshot(...)`` for the code ``%fsdp snapshot`` and the Snapshots
    panel run (:mod:`fsdp_interactive.notebook._snapshot_taking`); ``None`` for other code."""
    if _SNAPSHOT_SCRATCH not in source:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "snapshot"
        ):
            call = ast.Call(
                ast.Attribute(ast.Name("fsdp_interactive", ast.Load()), "snapshot", ast.Load()),
                node.args,
                node.keywords,
            )
            return ast.unparse(call)
    return None


def _script_what(record: ScriptRecord) -> str:
    where = f"its pause after step {record.steps}" if record.state == "paused" else "its end"
    if record.kind == "run":
        return f"runs {record.label} as the pool did, to {where}"
    if record.state == "stopped":
        return f"stops {record.label} at its pause"
    return f"continues {record.label} to {where}"


def _script_call(entry: JournalEntry) -> str:
    record = entry.script
    assert record is not None
    stop_at = record.steps if record.state == "paused" else None
    if record.kind == "run":
        return (
            f"_export.run_script(globals(), _values, {str(entry.id)!r}, path={record.path!r}, "
            f"args={list(record.args)!r}, cwd={record.cwd!r}, stop_at={stop_at!r})"
        )
    return (
        f"_export.continue_script(globals(), stop_at={stop_at!r}, "
        f"stop={record.state == 'stopped'!r})"
    )


def script_sources(entries: Mapping[int, JournalEntry]) -> dict[str, str]:
    """The source of every script run among ``entries``, by entry id (for the values file)."""
    return {
        str(entry_id): str(entry.script.spec.get("source", ""))
        for entry_id, entry in entries.items()
        if isinstance(entry.script, ScriptRecord) and entry.script.kind == "run"
    }
