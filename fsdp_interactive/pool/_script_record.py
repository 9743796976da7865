"""What the journal keeps of a script run (``Pool.run_script``) or of its continuation
(``Pool.continue_script``): enough to run it again to the same step.

A run is one journal entry like a cell; each ``continue`` is another entry of the same
run (``run``: the id of the run's entry). Once a call ends, its entry's ``source`` is
rewritten to the call that reproduces what happened (:func:`replay_code`): the script
started again with ``stop_at`` set to the step the original paused at (an interrupt's pause
included), or run to its end; a continuation resumed to the step where it paused, or
stopped. A recovery's replay (:mod:`._replay`) runs that source as it runs a cell's, with
the generators the original had; the slice keeps a run's entries together
(:func:`script_groups`), and :func:`replay_refusal` says when a run cannot be replayed
for a snapshot.

Kernel side, plain data; the script's source is kept here so that a replay runs what ran
even when the file has changed since.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RUN_MODULE = "fsdp_interactive.pool.rank._script_run"


@dataclass
class ScriptRecord:
    """One script call in the journal.

    ``kind``: ``"run"`` or ``"continue"``; ``run``: the journal id of the run's entry (its
    own for a run); ``path``, ``args``, ``cwd``, ``source``, ``digest`` (SHA-256 of the
    source): the script as it ran; ``world_size``: the pool's ranks then; ``spec``: what the
    ranks were sent (with ``stop_at`` as asked); ``state`` and ``steps`` once it returned:
    ``"paused"`` after ``steps`` optimizer steps, ``"ended"``, ``"stopped"``, ``"failed"``,
    ``"interrupted"``.
    """

    kind: str
    run: int
    path: str
    args: tuple[str, ...]
    cwd: str
    digest: str
    world_size: int
    spec: dict[str, Any] = field(default_factory=dict)
    state: str = "running"
    steps: int | None = None

    @property
    def label(self) -> str:
        """The script's file name."""
        return self.path.rsplit("/", 1)[-1]


def call_code(function: str, spec: Mapping[str, Any]) -> str:
    """The code every rank runs for a script call: ``function`` (``start`` or ``resume``) of
    the rank-side runner with the engine's namespace and ``spec`` (plain data, as a
    literal)."""
    return f"__import__({RUN_MODULE!r}, fromlist=['start']).{function}(globals(), {dict(spec)!r})\n"


def received_call(key: str) -> str:
    """The code that starts the run whose spec the ranks were sent under ``key``."""
    return f"__import__({RUN_MODULE!r}, fromlist=['start']).start_received(globals(), {key!r})\n"


def replay_code(record: ScriptRecord) -> str:
    """The call that does again what the recorded one did (module docstring)."""
    spec = dict(record.spec)
    if record.state == "paused":
        spec["stop_at"] = record.steps
        spec.pop("stop", None)
    elif record.state == "stopped":
        spec["stop"] = True
    else:
        spec["stop_at"] = None
    return call_code("start" if record.kind == "run" else "resume", spec)


def script_groups(entries: Sequence[Any]) -> dict[int, list[Any]]:
    """The journal entries of each script run among ``entries`` (run id -> its entries,
    oldest first); entries without a script record are left out."""
    groups: dict[int, list[Any]] = {}
    for entry in entries:
        record = getattr(entry, "script", None)
        if isinstance(record, ScriptRecord):
            groups.setdefault(record.run, []).append(entry)
    return groups


def replay_refusal(
    replayed: Sequence[Any],
    taken_in: Any | None,
    world: int | None,
    dropped_hosts: Sequence[str] = (),
) -> str | None:
    """Why a recovery cannot replay the script runs it needs, or ``None``.

    ``replayed``: the entries the recovery replays; ``taken_in``: the journal entry the
    snapshot was taken during (``None``: outside any call); ``world``: the ranks it
    recovers onto (``None``: as many as before); ``dropped_hosts``: lost hosts it leaves out.
    """
    record = getattr(taken_in, "script", None)
    if isinstance(record, ScriptRecord):
        return (
            f"the snapshot was taken by the script {record.label} itself while it ran "
            f"({taken_in.label}), at a point where no replay can stop it; take snapshots "
            "while the script is paused (stop_at=N, then a snapshot)"
        )
    for group in script_groups(replayed).values():
        first = group[0].script
        if first.kind != "run":
            return (
                f"the script run that {group[0].label} continues is not in this epoch of "
                "the journal, so it cannot be run again to its pause"
            )
        ranks = first.world_size if world is None and not dropped_hosts else world
        if ranks != first.world_size:
            onto = f"on {ranks} ranks" if ranks is not None else "without the lost hosts"
            return (
                f"the script run {group[0].label} ({first.label}) ran on {first.world_size} "
                f"ranks; run again {onto} its data and steps would differ, so its pause "
                "could not be reached as it was"
            )
    return None
