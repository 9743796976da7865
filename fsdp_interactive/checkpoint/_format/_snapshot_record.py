"""What a snapshot is, as plain data: :class:`SnapshotRecord`, also its ``snapshot.json``
(:data:`RECORD_FORMAT`, :data:`RECORD_VERSION`).

A frozen dataclass of strings, numbers, lists and dicts, so that it travels to the notebook
kernel (a notice, an ipyparallel reply) and into JSON unchanged. Nothing here touches files
or other ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fsdp_interactive._text import snapshot_objects
from fsdp_interactive.checkpoint.errors import CorruptCheckpointError

RECORD_FORMAT = "fsdp-interactive-snapshot"
RECORD_VERSION = 1


@dataclass(frozen=True)
class SnapshotRecord:
    """One published snapshot, identical on every rank and in every host's ``snapshot.json``.

    * ``id``: ``"s000001"``, ``"s000002"``, ... (sorts by time of taking);
    * ``step``: the ``step`` given to :func:`snapshot` (``None`` when not given);
    * ``created``: unix time at which :func:`snapshot` was called (the state's time);
    * ``world_size`` and ``hosts``: the ranks that took it and the host of each, by rank;
    * ``names``: ``{"model": str | None, "optimizer": str | None, "stateful": {keyword:
      str | None}}``, where each object was in the calling cell's namespace: a variable
      (``"model"``) or an attribute path from one (``"trainer.model_wrapped"``); ``None``:
      not given, or (outside a pool's notebook call) found nowhere there;
    * ``keys``: the model's state keys (clean FQNs, sorted), to refuse another model;
    * ``bytes_per_host``: bytes of the data files (``.distcp`` files and ``.metadata``)
      each host holds, the ring copies included;
    * ``seconds``: the blocking part of the call (all of it for a synchronous snapshot,
      the staging for ``background=True``);
    * ``call``: the notebook call (journal entry) that took it, ``None`` outside a pool;
    * ``held_at``: every location (variable or attribute path) of the modules it holds when
      it was taken (``model``, ``trainer.model``): a recovery skips the initialization of
      tensors that ended there, since it writes them;
    * ``dropped``: the snapshots of the same objects that taking it removed (``keep_last``),
      set on the record the call returns and its notice, not in ``snapshot.json``.

    Shown as one line (``<snapshot s000007 of step 30: model, optim>``), as a notebook
    shows the value of a cell's last line.
    """

    id: str
    step: int | None
    created: float
    world_size: int
    hosts: list[str]
    names: dict[str, Any]
    keys: list[str]
    bytes_per_host: dict[str, int]
    seconds: float
    call: int | None = None
    held_at: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The record as a dict of plain data (a deep copy)."""
        return asdict(self)

    def to_json(self) -> str:
        """The record as the JSON text stored with the snapshot (format name and version included)."""
        data = {"format": RECORD_FORMAT, "format_version": RECORD_VERSION, **self.to_dict()}
        del data["dropped"]  # what taking it removed is not the snapshot's to keep
        return json.dumps(data, indent=2, sort_keys=True)

    def objects(self) -> tuple:
        """What identifies the set of objects it holds (where the model, the optimizer and
        each stateful keyword's object were): ``keep_last`` counts snapshots per set."""
        names = self.names or {}
        stateful = names.get("stateful") or {}
        return (
            names.get("model"),
            names.get("optimizer"),
            tuple(sorted((str(k), v) for k, v in stateful.items())),
        )

    def holding(self) -> str:
        """The objects it holds, where they were: ``model, optim, sched``."""
        return snapshot_objects(self.names)

    def __repr__(self) -> str:
        step = f" of step {self.step}" if self.step is not None else ""
        dropped = f"; dropped {', '.join(self.dropped)}" if self.dropped else ""
        return f"<snapshot {self.id}{step}: {self.holding()}{dropped}>"

    @classmethod
    def from_json(cls, text: str, source: Path | str) -> SnapshotRecord:
        """The record in ``text`` (the content of ``source``); :class:`CorruptCheckpointError`
        naming ``source`` when it is not a snapshot record of this format."""
        try:
            data = json.loads(text)
            if data.get("format") != RECORD_FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {RECORD_FORMAT!r}")
            if data.get("format_version") != RECORD_VERSION:
                raise ValueError(f"unsupported format_version {data.get('format_version')!r}")
            names = data["names"]
            return cls(
                id=str(data["id"]),
                step=None if data["step"] is None else int(data["step"]),
                created=float(data["created"]),
                world_size=int(data["world_size"]),
                hosts=[str(h) for h in data["hosts"]],
                names={
                    "model": names.get("model"),
                    "optimizer": names.get("optimizer"),
                    "stateful": dict(names.get("stateful", {})),
                },
                keys=[str(k) for k in data["keys"]],
                bytes_per_host={str(h): int(b) for h, b in data["bytes_per_host"].items()},
                seconds=float(data["seconds"]),
                call=None if data.get("call") is None else int(data["call"]),
                held_at=[str(w) for w in data.get("held_at") or ()],
            )
        except Exception as exc:
            raise CorruptCheckpointError(
                f"{source}: invalid snapshot record ({type(exc).__name__}: {exc})",
                file=str(source),
            ) from exc
