"""Which journal entries a recovery replays: the slice of the notebook behind a snapshot.

A snapshot restores a few objects (the model, the optimizer, the stateful objects), found
after the replay where it recorded them (a name, or an attribute path such as
``trainer.model_wrapped``: its *root* is ``trainer``). The replay has to recreate those
roots and what they are built from; everything else the snapshot either holds (the effect
of every training step) or does not need. Walking the candidate entries backwards (those
that succeeded before the snapshot's cell, :meth:`~._journal.Journal.replay_for`), with the
set of *needed* names starting as the roots, an entry is replayed when:

1. it is marked ``%%fsdp --replay`` (forced);
2. it **defines** a needed name (its code binds it, :mod:`._cell_effects`, or the ranks saw
   the name's object replaced while it ran);
3. it **changes** a needed name's object in a way the snapshot cannot give back: for a
   root, only what no ``state_dict`` holds (a hook, a submodule, ``requires_grad``, dtype or
   device, sharding in place; in the code, or seen by the ranks as a change of the module's
   hooks, submodules or parameters); for any other needed name, any change (an attribute
   or item set, a method called for its effect), since nothing restores those;
4. it changes the **process** (``torch.set_default_dtype``, ``sys.path``, ``os.environ``,
   warnings filters): later cells run differently without it; or
5. it only **defines** (imports, functions, classes, constants): free to run, and the
   cells run after the recovery call its functions.

A replayed entry's reads become needed (for 5, only what it reads while it runs, not its
functions' bodies); a name it binds on every path is no longer needed before it. Every
other entry is skipped, with why: a training loop, an evaluation, a save or a print
*uses* the restored objects, and the snapshot holds what it did to them. ``--no-replay``
keeps an entry out whatever it does.

The init-skipping mark (:attr:`Part.skip_init`) goes on the entries replayed for the
model's root or what it is built from: their parameters' initial values are overwritten by
the snapshot, so the replay need not draw them (:mod:`.rank._init_deferral`).

A snapshot without recorded locations (taken by older versions) keeps the former rule:
every candidate is replayed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.pool._cell_effects import PREFILLED_MODULES
from fsdp_interactive.pool._journal import JournalEntry
from fsdp_interactive.pool._script_record import script_groups

#: The kinds of object a snapshot restores, as its record names them.
_KINDS = {"model": "the model", "optimizer": "the optimizer"}


@dataclass(frozen=True)
class Part:
    """One candidate entry's part in a recovery: replayed or not, and why."""

    entry: JournalEntry
    replay: bool
    why: str
    #: Replayed for the model's root: parameter initialization may be skipped.
    skip_init: bool = False

    def line(self) -> str:
        """``In[2] defines model, optim`` or ``In[5] skipped: defines nothing the
        snapshot needs``."""
        if self.replay:
            return f"{self.entry.label} {self.why}"
        return f"{self.entry.label} skipped: {self.why}"


@dataclass(frozen=True)
class ReplaySlice:
    """Every candidate entry's :class:`Part`, oldest first."""

    parts: tuple[Part, ...] = ()

    @property
    def replay(self) -> tuple[JournalEntry, ...]:
        return tuple(p.entry for p in self.parts if p.replay)

    @property
    def skip_init(self) -> frozenset[int]:
        """Ids of the replayed entries whose parameter initialization may be skipped."""
        return frozenset(p.entry.id for p in self.parts if p.replay and p.skip_init)

    def lines(self) -> list[str]:
        return [p.line() for p in self.parts]


@dataclass
class _Need:
    why: str
    model: bool  # on the model's chain (for init skipping)
    restored: bool  # a root the snapshot restores into


def roots_of(names: Mapping[str, Any] | None) -> dict[str, tuple[str, bool]] | None:
    """``{root name: (what it holds for the snapshot, holds the model)}`` from a snapshot's
    recorded locations; ``None`` when the model's location is unknown."""
    if not names or not isinstance(names.get("model"), str):
        return None
    located: list[tuple[str, str]] = [
        (str(names[kind]), label)
        for kind, label in _KINDS.items()
        if isinstance(names.get(kind), str)
    ]
    located += [
        (str(path), f"'{keyword}'")
        for keyword, path in (names.get("stateful") or {}).items()
        if isinstance(path, str)
    ]
    roots: dict[str, tuple[str, bool]] = {}
    for path, label in located:
        root = path.split(".", 1)[0]
        shown = label if path == root else f"{label} ({path})"
        what, model = roots.get(root, ("", False))
        roots[root] = (f"{what}, {shown}" if what else shown, model or label == "the model")
    return roots


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def slice_for(candidates: Sequence[JournalEntry], names: Mapping[str, Any] | None) -> ReplaySlice:
    """The parts of ``candidates`` (oldest first) in a recovery to a snapshot whose objects
    are recorded at ``names`` (a snapshot record's ``names``); see the module's docstring."""
    roots = roots_of(names)
    if roots is None:
        return _every_candidate(candidates)
    need = {root: _Need(f"restores {what}", model, True) for root, (what, model) in roots.items()}
    modules = set(PREFILLED_MODULES).union(*(e.effects.imports for e in candidates))
    parts: list[Part] = []
    for entry in reversed(candidates):
        parts.append(_part(entry, need, modules, set(roots)))
    return ReplaySlice(tuple(_whole_script_runs(parts[::-1])))


def _kills(entry: JournalEntry) -> set[str]:
    """The names ``entry`` binds on every path: its code's, and for a script run the names
    the ranks saw it bind (a run binds all it keeps, whatever they are)."""
    if entry.script is not None:
        return set(entry.effects.kills) | set(entry.rebound)
    return set(entry.effects.kills)


def _whole_script_runs(parts: Sequence[Part]) -> list[Part]:
    """A script run's entries (its start and each continue, ``Pool.run_script``) are
    replayed together or not at all: its pause before the snapshot is reached only by
    running the script from its start through every continue before the snapshot. Their
    parameter initialization is never skipped: the script trains on the parameters
    before it pauses."""
    groups = script_groups([part.entry for part in parts])
    replayed = {
        run
        for run, entries in groups.items()
        if any(p.replay for p in parts if any(p.entry is e for e in entries))
    }
    whole = []
    for part in parts:
        record = part.entry.script
        if record is None or record.run not in replayed:
            whole.append(part)
            continue
        where = f"after step {record.steps}" if record.state == "paused" else "its end"
        verb = "runs" if record.kind == "run" else "continues"
        what = f"{verb} {record.label} to {'its pause ' if record.state == 'paused' else ''}{where}"
        why = f"{what}, which {part.why}" if part.replay else f"{what} (the run is replayed whole)"
        whole.append(Part(part.entry, True, why, skip_init=False))
    return whole


def _every_candidate(candidates: Sequence[JournalEntry]) -> ReplaySlice:
    """The rule for a snapshot without recorded locations: every candidate but those
    marked ``--no-replay``."""
    parts = []
    for entry in candidates:
        if entry.replay is False:
            parts.append(Part(entry, False, "marked %%fsdp --no-replay"))
        else:
            why = "replayed: the snapshot does not say where its objects live"
            parts.append(Part(entry, True, why))
    return ReplaySlice(tuple(parts))


def _part(entry: JournalEntry, need: dict[str, _Need], modules: set[str], roots: set[str]) -> Part:
    """``entry``'s part, given what later replayed entries and the snapshot need; updates
    ``need`` with what a replayed ``entry`` reads and no longer needs."""
    if entry.replay is False:
        return Part(entry, False, "marked %%fsdp --no-replay")
    fx = entry.effects
    if not fx.parsed:
        defined = sorted(need)
        changed: list[str] = []
    else:
        defined = sorted(n for n in need if n in fx.defines or n in entry.rebound)
        changed = sorted(
            n
            for n in need
            if n not in defined
            and (
                n in entry.reshaped
                or n in fx.reshapes
                or (not need[n].restored and n in fx.mutates)
            )
        )
    reasons = ["forced by %%fsdp --replay"] if entry.replay else []
    if not fx.parsed:
        reasons.append("its code could not be read, so it may define anything")
    elif defined:
        reasons.append(_defines(entry, defined, need))
    if changed:
        reasons.append("changes " + "; ".join(f"{n} ({_change(entry, n)})" for n in changed))
    settings = fx.settings(modules)
    if settings:
        reasons.append(f"changes the process ({_names(settings[:3])})")
    if reasons:
        model_chain = any(need[n].model for n in [*defined, *changed])
        for name in _kills(entry) & set(defined):
            if name not in changed:
                del need[name]
        for name in sorted(fx.reads):
            need.setdefault(name, _Need(f"read by {entry.label}", model_chain, False))
        return Part(entry, True, "; ".join(reasons), skip_init=model_chain)
    if fx.definitions_only:
        for name in sorted(fx.reads_now):
            need.setdefault(name, _Need(f"read by {entry.label}", False, False))
        what = "only imports and defines functions, classes and constants"
        return Part(entry, True, f"{what}: kept for the cells run after the recovery")
    used = sorted(n for n in roots if n in fx.reads or n in fx.mutates)
    if used:
        return Part(entry, False, f"uses {_names(used)}, whose state the snapshot holds")
    return Part(entry, False, "defines nothing the snapshot needs")


def _defines(entry: JournalEntry, defined: Sequence[str], need: Mapping[str, _Need]) -> str:
    """``defines model, optim`` (what the snapshot restores into), then the other names
    with who reads them: ``defines config (read by In[3])``; names only the ranks saw it
    rebind say so."""

    def shown(name: str) -> str:
        seen = "" if name in entry.effects.defines else ", seen after it ran"
        reader = "" if need[name].restored else need[name].why
        detail = ", ".join(filter(None, [reader, seen.removeprefix(", ")]))
        return f"{name} ({detail})" if detail else name

    restored = [n for n in defined if need[n].restored]
    others = [n for n in defined if not need[n].restored]
    return "defines " + ", ".join(shown(n) for n in [*restored, *others])


def _change(entry: JournalEntry, name: str) -> str:
    fx = entry.effects
    if name in fx.reshapes:
        return fx.reshapes[name]
    if name in entry.reshaped:
        return f"its {entry.reshaped[name]}, seen after it ran"
    return fx.mutates.get(name, "changed")
