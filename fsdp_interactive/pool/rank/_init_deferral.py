"""Rank side: the parameter initializations of a notebook cell, recorded when it first runs
and skipped, when a recovery replays it, exactly for the tensors the snapshot writes.

Building GPT-2 small on a CPU rank spends seconds drawing initial weights that the
snapshot replaces a moment later. The ``torch.nn.init`` functions (``normal_``,
``uniform_``, ``kaiming_uniform_``, ... as transformers' ``no_init_weights`` lists them:
in ``torch.nn.init``, in the ``torch.nn.modules`` that bound them by name, and the table
transformers' own initialization calls) are wrapped once per process (:func:`install`,
before any cell's imports, also in the engine forker): outside a session a wrapper only
calls the function.

**Recording** (:class:`InitRecorder`, around every journaled cell): each outermost call
on the cell's thread is numbered and noted with its function, its tensor's shape and the
module parameters the tensor is (from torch's parameter registration hook, also for a
tensor registered after its initialization). When the cell ends, each call gets the
*locations* of the objects that hold its tensor: the public names of the namespace (and
their attributes one level deep, ``trainer.model``) whose module contains a module the
tensor is a parameter of. Sharding keeps the module objects (``fully_shard``, this
package's FSDP, torch's FSDP1), so a parameter that sharding replaced is found all the
same. The kernel keeps the list (:meth:`~fsdp_interactive.pool._journal.Journal.note_cell`).

**Skipping** (:class:`InitSkipper`, around a replayed cell): the kernel names the first
call from which every call's tensor is held by an object the snapshot restores (the
cell's *restored suffix*, :func:`fsdp_interactive.pool._replay.restored_suffix`). Calls before it run as they did, with
the generators as the original had them at that point (the replay starts the cell with
the original's generators, and nothing before drew less): the values of every tensor the
snapshot does not write are what the cell built, bit for bit. Calls from it on, for
plain whole tensors, return the tensor as allocated: the restore overwrites it. A replay
whose calls stop matching the original's (another function or shape at the same number:
the cell took another path) skips nothing more.

**The check** (:meth:`InitSkipper.unset`): after the replay, every skipped tensor must be
a parameter of a module inside an object the snapshot restores; those that are not (a
name rebound since the original ran) are named, and the recovery replays again with every
initialization run rather than report success over uninitialized memory.

What this does not change: random numbers a replayed cell draws outside ``torch.nn.init``
after the first skipped call are not the original's (the generators did not advance over
the skipped draws); the replay sets the generators to what the original left at the
cell's end (:mod:`._cell_watch`), so the cells after it draw the original's numbers.

Faults: everything here is this process's; a rank that dies takes its session with it.
The wrappers stay for the life of the process and only count while a session runs on the
thread that started it.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: The initialization functions recorded (as transformers' ``TORCH_INIT_FUNCTIONS``).
INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
#: Where transformers keeps the functions its own initialization calls.
_TRANSFORMERS_TABLE = ("transformers.initialization", "TORCH_INIT_FUNCTIONS")
#: Marks a wrapper (never wrapped twice).
_WRAPPED = "_fsdpi_init_call"
#: Objects whose attributes are not looked into for modules: classes, modules, functions.
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)

#: One call as the kernel keeps it: ``(function, shape, locations)``.
CallRecord = tuple[str, tuple[int, ...], tuple[str, ...]]

_session: _Session | None = None
_torch_patched = False


# ---------------------------------------------------------------------------- wrappers


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, _WRAPPED, False):
        return fn

    @functools.wraps(fn)
    def init_call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session
        if session is None or session.depth or threading.get_ident() != session.thread:
            return fn(tensor, *args, **kwargs)
        return session.call(name, fn, tensor, args, kwargs)

    setattr(init_call, _WRAPPED, True)
    return init_call


def install() -> None:
    """Wrap the initialization functions of this process (once; transformers' table also
    when it was imported since). Call it before the cells' imports, so that a module that
    binds a function by name binds the wrapper, in the first group as in a recovery's."""
    global _torch_patched
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if not _torch_patched:
        originals = {name: getattr(torch.nn.init, name) for name in INIT_FUNCTIONS}
        wrappers = {name: _wrap(name, fn) for name, fn in originals.items()}
        for module_name, module in list(sys.modules.items()):
            if module is None or not (
                module_name == "torch.nn.init" or module_name.startswith("torch.nn.modules.")
            ):
                continue
            for name, fn in originals.items():
                if vars(module).get(name) is fn:
                    setattr(module, name, wrappers[name])
        _torch_patched = True
    table_module = sys.modules.get(_TRANSFORMERS_TABLE[0])
    table = getattr(table_module, _TRANSFORMERS_TABLE[1], None)
    if isinstance(table, dict):
        for name, fn in list(table.items()):
            if callable(fn) and name in INIT_FUNCTIONS and not getattr(fn, _WRAPPED, False):
                table[name] = _wrap(name, fn)


# ---------------------------------------------------------------------------- sessions


def _whole(tensor: Any) -> bool:
    """A plain tensor that owns its storage from the start (not a view into another)."""
    try:
        return (
            type(tensor).__name__ in ("Tensor", "Parameter")
            and tensor.storage_offset() == 0
            and tensor.is_contiguous()
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        )
    except (RuntimeError, NotImplementedError):  # meta tensors, tensor subclasses
        return False


def _shape(tensor: Any) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in tensor.shape)
    except Exception:
        return ()


@dataclass
class _Call:
    """One initialization call of a session."""

    function: str
    shape: tuple[int, ...]
    tensor: Any  # a weak reference, or None
    owners: list[tuple[Any, str]]  # (weak reference to a module, parameter name)
    skipped: bool = False


class _Owners:
    """The modules each parameter was registered in during a session (torch's global
    parameter registration hook), by the parameter's identity."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, list[tuple[Any, str]]]] = {}
        self._prune_at = 4096
        self._handle: Any = None

    def start(self) -> None:
        from torch.nn.modules.module import register_module_parameter_registration_hook

        self._handle = register_module_parameter_registration_hook(self._registered)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _registered(self, module: Any, name: str, param: Any) -> None:
        if param is None:
            return
        known = self._by_id.get(id(param))
        if known is None or known[0]() is not param:
            known = (weakref.ref(param), [])
            self._by_id[id(param)] = known
        known[1].append((weakref.ref(module), name))
        if len(self._by_id) > self._prune_at:  # FSDP1 registers new views every forward
            self._by_id = {k: v for k, v in self._by_id.items() if v[0]() is not None}
            self._prune_at = 2 * len(self._by_id) + 4096

    def of(self, tensor: Any) -> list[tuple[Any, str]]:
        known = self._by_id.get(id(tensor))
        return list(known[1]) if known is not None and known[0]() is tensor else []


class _Session:
    """The initialization calls on the thread that started it, between :meth:`start` and
    :meth:`stop`."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.depth = 0  # inside a recorded call: the calls it makes itself are not counted
        self.calls: list[_Call] = []
        self.owners = _Owners()

    def start(self) -> None:
        global _session
        install()
        self.owners.start()
        _session = self

    def stop(self) -> None:
        global _session
        if _session is self:
            _session = None
        self.owners.stop()

    def call(self, name: str, fn: Callable[..., Any], tensor: Any, args: tuple, kwargs: dict):
        try:
            ref: Any = weakref.ref(tensor)
        except TypeError:
            ref = None
        record = _Call(name, _shape(tensor), ref, self.owners.of(tensor))
        index = len(self.calls)
        self.calls.append(record)
        if self.skips(index, record, tensor):
            record.skipped = True
            return tensor
        self.depth += 1
        try:
            return fn(tensor, *args, **kwargs)
        finally:
            self.depth -= 1

    def skips(self, index: int, record: _Call, tensor: Any) -> bool:
        return False

    def owner_modules(self, record: _Call) -> list[tuple[Any, str]]:
        """The live ``(module, name)`` pairs the call's tensor is a parameter of: where it
        was when called, and where it was registered after (then still alive)."""
        pairs = list(record.owners)
        tensor = record.tensor() if record.tensor is not None else None
        if tensor is not None:
            pairs += self.owners.of(tensor)
        found, seen = [], set()
        for module_ref, name in pairs:
            module = module_ref()
            if module is not None and (id(module), name) not in seen:
                seen.add((id(module), name))
                found.append((module, name))
        return found


def module_locations(namespace: Mapping[str, Any]) -> dict[int, set[str]]:
    """``{id(module): locations}``: for every module reachable from the public names of
    ``namespace`` (a module held by a name, or by a public attribute of a non-module
    object held by a name, such as ``trainer.model``), the names or paths whose module
    contains it."""
    import torch

    found: dict[int, set[str]] = {}

    def add(location: str, root: Any) -> None:
        for sub in root.modules():
            found.setdefault(id(sub), set()).add(location)

    module = torch.nn.Module
    for name, value in list(namespace.items()):
        if not isinstance(name, str) or name.startswith("_"):
            continue
        # type(): never the object's own __class__ (a deprecated torch name warns on it).
        kind = type(value)
        if issubclass(kind, module):
            add(name, value)
        elif issubclass(kind, _OPAQUE) or not isinstance(getattr(value, "__dict__", None), dict):
            continue
        else:
            for attribute, held in list(vars(value).items()):
                public = isinstance(attribute, str) and not attribute.startswith("_")
                if public and issubclass(type(held), module):
                    add(f"{name}.{attribute}", held)
    return found


class InitRecorder(_Session):
    """Records a journaled cell's initialization calls (module docstring)."""

    def records(self, namespace: Mapping[str, Any]) -> list[CallRecord]:
        """Each call's ``(function, shape, locations)``, once the cell has ended."""
        if not self.calls:
            return []
        where = module_locations(namespace)
        found = []
        for record in self.calls:
            locations: set[str] = set()
            for module, _ in self.owner_modules(record):
                locations |= where.get(id(module), set())
            found.append((record.function, record.shape, tuple(sorted(locations))))
        return found


@dataclass
class Tally:
    """What a replay's sessions did: calls skipped and run, and the skipped calls whose
    tensor no restored object holds (:meth:`InitSkipper.unset`)."""

    skipped: int = 0
    run: int = 0
    unset: list[str] = field(default_factory=list)


class InitSkipper(_Session):
    """Skips a replayed cell's initialization calls from ``skip_from`` on, while they match
    ``expected`` (the original's ``(function, shape)`` by number); ``None``: skips none,
    and only counts them."""

    def __init__(
        self, skip_from: int | None, expected: Sequence[tuple[str, Sequence[int]]]
    ) -> None:
        super().__init__()
        self.skip_from = skip_from
        self.expected = [(str(f), tuple(int(n) for n in s)) for f, s in expected]
        self.diverged = False

    def skips(self, index: int, record: _Call, tensor: Any) -> bool:
        if self.diverged or self.skip_from is None:
            return False
        if index >= len(self.expected) or self.expected[index] != (record.function, record.shape):
            self.diverged = True
            log.info(
                "replay: initialization call %d (%s of %s) differs from the original's; "
                "nothing more is skipped in this cell",
                index,
                record.function,
                record.shape,
            )
            return False
        return index >= self.skip_from and _whole(tensor)

    def settle(self, tally: Tally) -> None:
        """Add this cell's counts to ``tally`` (the check comes after every replayed cell:
        :meth:`unset`)."""
        for record in self.calls:
            if record.skipped:
                tally.skipped += 1
            else:
                tally.run += 1

    def unset(self, namespace: Mapping[str, Any], restored: Sequence[Any]) -> list[str]:
        """The skipped calls whose tensor is not a parameter of a module inside one of the
        ``restored`` objects (which the snapshot is about to write), named by where they
        are: ``a.blocks.0.attn.in_proj_weight (normal_)``."""
        import torch

        held: set[int] = set()
        for obj in restored:
            if isinstance(obj, torch.nn.Module):
                held.update(id(sub) for sub in obj.modules())
        where: dict[int, set[str]] | None = None
        names: dict[int, str] = {}
        unset = []
        for record in self.calls:
            if not record.skipped:
                continue
            owners = self.owner_modules(record)
            if any(id(module) in held for module, _ in owners):
                continue
            if where is None:
                where = module_locations(namespace)
                for location in sorted(set().union(*where.values()) if where else ()):
                    root = follow(namespace, location)
                    if isinstance(root, torch.nn.Module):
                        for path, sub in root.named_modules():
                            names.setdefault(id(sub), f"{location}.{path}" if path else location)
            shown = [
                f"{names[id(module)]}.{name}" if id(module) in names else f"{name} of a module"
                for module, name in owners
            ]
            what = shown[0] if shown else f"a tensor of shape {list(record.shape)}"
            unset.append(f"{what} ({record.function})")
        return unset


def follow(namespace: Mapping[str, Any], location: str) -> Any:
    """The object at ``location`` (``name`` or ``name.attr...``) in ``namespace``, or
    ``None``."""
    root, *attributes = location.split(".")
    value = namespace.get(root)
    for attribute in attributes:
        value = getattr(value, attribute, None)
    return value
