"""Rank side: what each notebook cell did to this rank, told to the kernel; and a recovery's
replay of a cell, run with the generators the original had.

:mod:`._engine_shell` calls :func:`before_cell` and :func:`after_cell` around every cell the
engine's shell runs (IPython's ``pre_run_cell`` and ``post_run_cell``).

**A journaled call** (:func:`fsdp_interactive._notices.current_call` is its entry): at its
start this rank notes its random generators (:func:`capture_generators`), which object each
public name of the namespace holds, and the shape of each module and optimizer there
(submodules, the hooks the notebook's own code registered, parameter names and
``requires_grad``; optimizer parameter groups: what no ``state_dict`` holds); at its end the same again. It then sends the kernel a notice of
kind ``"cell"``: the generators at start and end (as digests, with the states the kernel has
not had from this process yet), the names whose object changed identity (``rebound``: what
the code does not show, such as a function assigning a ``global``) and the names whose
module or optimizer changed shape (``reshaped``: a hook registered inside a helper).
The journal keeps them (:meth:`~fsdp_interactive.pool._journal.Journal.note_cell`).

The notice also holds the public names of the namespace after the call (``names``: what a
recovery's report compares with what it brought back) and, for a call that initialized
parameters, each ``torch.nn.init`` call with where its tensor ended (``inits``:
:mod:`._init_deferral`).

**A replayed entry** (a recovery runs it with its entry's id, after
:func:`prepare_replay` gave this rank the original's generators and, per entry, the
initialization calls it may skip): at its start the generators are set to the original's
start and the initialization calls are counted, those the snapshot writes skipped
(:mod:`._init_deferral`); at its end the generators are set to the original's end, so that
the cells after it draw the numbers they drew the first time. :func:`finish_replay` then
checks that every skipped tensor belongs to an object the snapshot restores.

Faults: everything here is this process's; a rank that dies loses its unsent report of the
cell it died in (that cell failed, and is never replayed). A failure to capture or report
is logged and never fails the user's cell.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import random
import sys
import sysconfig
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_interactive import _notices
from fsdp_interactive.pool.rank import _init_deferral

log = logging.getLogger(__name__)

#: IPython's own names in an engine's namespace (ipykernel's ``open`` too), never the
#: notebook's state.
_SHELL_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython", "open"})


# ---------------------------------------------------------------------------- generators


def capture_generators() -> dict[str, Any]:
    """This process's generators as plain data: torch's CPU generator (``"torch"``, bytes),
    the current CUDA device's when CUDA is initialized (``"cuda"``), Python's ``random``
    (``"python"``) and NumPy's global generator when NumPy is imported (``"numpy"``).
    Nothing is imported or initialized to read them."""
    import torch

    state: dict[str, Any] = {
        "torch": bytes(torch.get_rng_state().tolist()),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = bytes(torch.cuda.get_rng_state().tolist())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (str(name), keys.tobytes(), int(pos), int(has_gauss), float(cached))
    return state


def apply_generators(state: Mapping[str, Any]) -> None:
    """Set the generators ``state`` holds (from :func:`capture_generators`; NumPy is
    imported when the state holds its generator)."""
    import torch

    torch.set_rng_state(torch.tensor(list(state["torch"]), dtype=torch.uint8))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(list(state["cuda"]), dtype=torch.uint8))
    if "numpy" in state:  # the original had imported NumPy: the replayed cell may draw
        import numpy

        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state(
            (name, numpy.frombuffer(keys, dtype=numpy.uint32).copy(), pos, has_gauss, cached)
        )


def digest(state: Mapping[str, Any]) -> str:
    """A short digest of a generator state (the kernel keeps each distinct one once)."""
    return hashlib.blake2b(pickle.dumps(dict(state), protocol=4), digest_size=12).hexdigest()


# ---------------------------------------------------------------------------- shapes


def _shape_of(obj: Any) -> dict[str, Any] | None:
    """What no ``state_dict`` holds of a module or optimizer (``None`` for other objects)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(obj, torch.nn.Module):
        from fsdp_interactive._torch_compat import MODULE_HOOK_DICTS, buffer_slots, parameter_slots

        # One walk over the module tree (GPT-2 small: about 2 ms a cell).
        modules, parameters, buffers = [], [], []
        hooks = 0
        for name, sub in obj.named_modules():
            modules.append((name, id(sub)))
            parameters += [
                (name, own, p is not None and p.requires_grad)
                for own, p in parameter_slots(sub).items()
            ]
            buffers += [(name, own) for own in buffer_slots(sub)]
            attributes = vars(sub)
            for registry in MODULE_HOOK_DICTS:
                registered = attributes.get(registry)
                if registered:
                    hooks += sum(1 for hook in registered.values() if _users_hook(hook))
        return {
            "submodules": hash(tuple(modules)),
            "hooks": hooks,
            "parameters (names, requires_grad)": hash(tuple(parameters)),
            "buffers": hash(tuple(buffers)),
        }
    if isinstance(obj, torch.optim.Optimizer):
        groups = obj.param_groups
        return {
            "parameter groups": hash(tuple((len(g["params"]), tuple(sorted(g))) for g in groups)),
        }
    return None


@functools.cache
def _library_folders() -> tuple[str, ...]:
    """Where installed code lives: the standard library, site-packages, and this package
    (an editable install lives outside site-packages)."""
    paths = sysconfig.get_paths()
    folders = {paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    folders.add(os.path.dirname(os.path.abspath(_notices.__file__)))  # fsdp_interactive/
    return tuple(os.path.join(os.path.abspath(f), "") for f in folders if f)


def _users_hook(hook: Any) -> bool:
    """A hook whose code is the notebook's own (a cell, or a module that is not an
    installed library): torch, this package and libraries register hooks for themselves
    inside their calls (FSDP adds state-dict hooks on its first forward; a framework's
    ``train()`` may add its own), which a call made again after a recovery adds again."""
    function = getattr(hook, "func", hook)  # functools.partial
    function = getattr(function, "__func__", function)  # bound methods
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    filename = os.path.abspath(code.co_filename) if os.path.isabs(code.co_filename) else ""
    return not filename or not filename.startswith(_library_folders())


def _shape_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    changed = []
    for key, value in after.items():
        if before.get(key) != value:
            if key == "hooks":
                changed.append(f"hooks ({before.get(key)} -> {value})")
            else:
                changed.append(key)
    return ", ".join(changed)


# ---------------------------------------------------------------------------- one cell


@dataclass
class _Watch:
    """What :func:`before_cell` noted for the journaled call it started."""

    call: int
    rng: dict[str, Any]
    held: dict[str, tuple[int, Any]] = field(default_factory=dict)
    shapes: dict[int, dict[str, Any]] = field(default_factory=dict)
    inits: _init_deferral.InitRecorder | None = None
    label: str = ""
    kept_out: bool = False


_watch: _Watch | None = None
#: Digests of the generator states this process sent the kernel.
_sent: set[str] = set()
#: The replay a recovery prepared: ``{entry: {"start", "end", "skip_init"}}``.
_replay_plan: dict[int, dict[str, Any]] = {}
#: The entry the cell about to run replays (set from its first line, :mod:`._engine_shell`).
_next_replay: int | None = None
_replaying: int | None = None
#: The initialization calls of the replayed entry running now, and of those that ran.
_skipper: _init_deferral.InitSkipper | None = None
_skippers: list[_init_deferral.InitSkipper] = []
#: What the next call is shown as and whether it is kept out of every recovery (set from
#: its first line, :mod:`._engine_shell`).
_next_label, _next_kept_out = "", False
#: The public names of the namespace when the replayed entry running now started.
_replay_held: dict[str, tuple[int, Any]] = {}


@dataclass(frozen=True)
class _Binding:
    """How a public name was last bound on this rank: by the call ``label``, the object
    ``ident`` (with a weak reference where one can be taken), and why a recovery would not
    bind it again (``None``: it would)."""

    label: str
    why_not: str | None
    ident: int
    ref: Any


#: Every public name a journaled call or a replay bound, as last bound.
_bindings: dict[str, _Binding] = {}


def _public(namespace: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: value
        for name, value in list(namespace.items())
        if isinstance(name, str) and not name.startswith("_") and name not in _SHELL_NAMES
    }


def public_names(namespace: Mapping[str, Any]) -> list[str]:
    """The public names of ``namespace`` (IPython's own left out), sorted."""
    return sorted(_public(namespace))


def _held(namespace: Mapping[str, Any]) -> dict[str, tuple[int, Any]]:
    """Each public name's object identity (and a weak reference where one can be taken, so
    that a new object at a freed one's address is told apart)."""
    held = {}
    for name, value in _public(namespace).items():
        try:
            ref: Any = weakref.ref(value)
        except TypeError:
            ref = None
        held[name] = (id(value), ref)
    return held


def _shapes(namespace: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    shapes: dict[int, dict[str, Any]] = {}
    for value in _public(namespace).values():
        if id(value) not in shapes:
            shape = _shape_of(value)
            if shape is not None:
                shapes[id(value)] = shape
    return shapes


def replaying_entry(entry: int | None) -> None:
    """The cell about to run replays journal entry ``entry`` (``None``: it does not)."""
    global _next_replay
    _next_replay = entry


def next_call(label: str, kept_out: bool) -> None:
    """The call about to run is shown as ``label`` (``In[3]``) and, with ``kept_out``, is
    never replayed by a recovery (``%%fsdp --no-replay``)."""
    global _next_label, _next_kept_out
    _next_label, _next_kept_out = label, kept_out


def _rebound(before: Mapping[str, tuple[int, Any]], now: Mapping[str, tuple[int, Any]]):
    return sorted(
        name
        for name, (ident, ref) in now.items()
        if name not in before
        or before[name][0] != ident
        or (before[name][1] is not None and before[name][1]() is None)
    )


def _bind(names: Sequence[str], now: Mapping[str, tuple[int, Any]], label: str, why_not):
    for name in names:
        ident, ref = now[name]
        _bindings[name] = _Binding(label, why_not, ident, ref)


def judge(name: str, value: Any) -> str | None:
    """Why a recovery would not bind ``name`` (holding ``value`` now) again, for
    :func:`fsdp_interactive._notices.unreplayed`; ``None`` when it would."""
    watch = _watch
    if watch is not None:
        before = watch.held.get(name)
        if before is None or before[0] != id(value):
            return (
                f"{watch.label or 'the call taking the snapshot'} binds {name!r}, and a "
                "recovery replays only the calls before the one that took the snapshot"
            )
    binding = _bindings.get(name)
    if binding is None or binding.ident != id(value) or (binding.ref and binding.ref() is None):
        return (
            f"no %%fsdp cell or Pool.run call bound {name!r} to what it holds now (Pool.push, "
            "%fsdp push or Pool.call did), so a recovery would not bind it again"
        )
    return binding.why_not


def before_cell(namespace: Mapping[str, Any]) -> None:
    """IPython ``pre_run_cell``: note the start of a journaled call, or set up a replay."""
    global _watch, _replaying, _skipper, _next_replay
    _watch = None
    replayed, _next_replay = _next_replay, None
    label, kept_out = _next_label, _next_kept_out
    next_call("", False)
    if replayed is not None and _notices.replaying():
        _replaying = replayed
        _replay_held.clear()
        _replay_held.update(_held(namespace))
        plan = _replay_plan.get(replayed, {})
        _set_generators(plan.get("start"), replayed)
        skip = plan.get("skip_init") or {}
        _skipper = _init_deferral.InitSkipper(skip.get("from"), skip.get("calls") or ())
        _skipper.start()
        return
    call = _notices.current_call()
    if call is None or _notices.replaying():
        return
    try:
        _watch = _Watch(call, capture_generators(), _held(namespace), _shapes(namespace))
        _watch.label, _watch.kept_out = label, kept_out
        _watch.inits = _init_deferral.InitRecorder()
        _watch.inits.start()
    except Exception as error:  # never fail the user's cell for the journal's sake
        log.warning("could not note the state before call %s: %s", call, error)


def after_cell(namespace: Mapping[str, Any], *, failed: bool = False) -> None:
    """IPython ``post_run_cell``: end a replayed entry, or report a journaled call
    (``failed``: the cell raised)."""
    global _watch, _replaying, _skipper
    if _replaying is not None:
        entry, _replaying = _replaying, None
        if _skipper is not None:
            _skipper.stop()
            _skippers.append(_skipper)
            _skipper = None
        _set_generators(_replay_plan.get(entry, {}).get("end"), entry)
        now = _held(namespace)
        _bind(_rebound(_replay_held, now), now, f"replayed entry {entry}", None)
        return
    watch, _watch = _watch, None
    if watch is None:
        return
    if watch.inits is not None:
        watch.inits.stop()
    try:
        now = _held(namespace)
        label = watch.label or f"call {watch.call}"
        why_not = (
            f"only {label} binds it, and {label} is marked --no-replay"
            if watch.kept_out
            else f"only {label} binds it, and {label} failed"
            if failed
            else None
        )
        _bind(_rebound(watch.held, now), now, label, why_not)
        for gone in set(_bindings) - set(now):
            del _bindings[gone]
    except Exception as error:
        log.warning("could not note what call %s bound: %s", watch.call, error)
    try:
        _notices.publish(_report(watch, namespace))
    except Exception as error:
        log.warning("could not report call %s to the kernel: %s", watch.call, error)


def _set_generators(state: Mapping[str, Any] | None, entry: int) -> None:
    if state is None:
        return
    try:
        apply_generators(state)
    except Exception as error:  # the replay goes on, with the generators as they are
        log.warning("could not set the generators of replayed entry %s: %s", entry, error)


def _report(watch: _Watch, namespace: Mapping[str, Any]) -> dict[str, Any]:
    end = capture_generators()
    states = {}
    marks = []
    for state in (watch.rng, end):
        mark = digest(state)
        marks.append(mark)
        if mark not in _sent:
            states[mark] = state
    _sent.update(states)
    now = _held(namespace)
    rebound = _rebound(watch.held, now)
    reshaped = {}
    for name, value in _public(namespace).items():
        before = watch.shapes.get(id(value))
        if before is None or name in rebound:
            continue
        after = _shape_of(value)
        if after is not None and after != before:
            reshaped[name] = _shape_change(before, after)
    report = {
        "kind": "cell",
        "call": watch.call,
        "rng_start": marks[0],
        "rng_end": marks[1],
        "states": states,
        "rebound": rebound,
        "reshaped": reshaped,
        "names": sorted(now),
    }
    inits = watch.inits.records(namespace) if watch.inits is not None else []
    if inits:
        report["inits"] = [[f, list(shape), list(where)] for f, shape, where in inits]
    return report


# ---------------------------------------------------------------------------- replays


def prepare_replay(plan: Mapping[int, Mapping[str, Any]]) -> int:
    """Take the replay a recovery is about to run: ``{entry: {"start": state, "end": state,
    "skip_init": {"from": n, "calls": [(function, shape), ...]} or None}}`` for this rank
    (``skip_init``: skip the entry's initialization calls from number ``n`` on, while they
    match the original's ``calls``). Returns how many entries have generator states."""
    _replay_plan.clear()
    _replay_plan.update({int(k): dict(v) for k, v in plan.items()})
    _skippers.clear()
    return sum(1 for v in _replay_plan.values() if v.get("start") is not None)


def finish_replay(namespace: Mapping[str, Any], restored: Sequence[str]) -> dict[str, Any]:
    """After the replay: how many initialization calls it skipped and ran, and the
    skipped ones whose tensor no object at ``restored`` (where the snapshot's objects are,
    names or attribute paths) holds: ``{"skipped": n, "initialized": m, "unset":
    [where, ...]}``."""
    _replay_plan.clear()
    skippers = list(_skippers)
    _skippers.clear()
    objects = [o for o in (_init_deferral.follow(namespace, p) for p in restored) if o is not None]
    tally = _init_deferral.Tally()
    for skipper in skippers:
        skipper.settle(tally)
        tally.unset += skipper.unset(namespace, objects)
    if tally.skipped or tally.run:
        log.info(
            "replay: %d parameter initializations skipped (the snapshot writes them), %d run",
            tally.skipped,
            tally.run,
        )
    return {"skipped": tally.skipped, "initialized": tally.run, "unset": tally.unset}
