"""What a snapshot is, as plain data: :class:`SnapshotRecord` (also its ``snapshot.json``)
and :class:`RestoreReport`.

Both are frozen dataclasses of strings, numbers, lists and dicts, so that they travel to
the notebook kernel (a notice, an ipyparallel reply) and into JSON unchanged. Nothing
here touches files or other ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    * ``call``: the notebook call (journal entry) that took it, ``None`` outside a pool.
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

    def to_dict(self) -> dict[str, Any]:
        """The record as a dict of plain data (a deep copy)."""
        return asdict(self)

    def to_json(self) -> str:
        """The record as the JSON text stored with the snapshot (format name and version included)."""
        data = {"format": RECORD_FORMAT, "format_version": RECORD_VERSION, **self.to_dict()}
        return json.dumps(data, indent=2, sort_keys=True)

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
            )
        except Exception as exc:
            raise CorruptCheckpointError(
                f"{source}: invalid snapshot record ({type(exc).__name__}: {exc})",
                file=str(source),
            ) from exc


@dataclass(frozen=True)
class RestoreReport:
    """What :func:`restore_snapshot` did (identical on every rank).

    ``names`` maps each restored keyword (``"model"``, ``"optimizer"``, the stateful
    keywords) to the variable it was loaded into (``"<objects>"`` when given through
    ``objects=``). ``copied_files`` / ``copied_bytes``: files sent between hosts so that
    every host held the whole snapshot (a host that lost its folder, or ranks placed on
    other hosts than when it was taken); ``repaired_files``: copies that failed their
    checksum and were replaced from a good copy on another host. ``missing_keys`` /
    ``unexpected_keys`` as in :class:`~fsdp_interactive.checkpoint.LoadReport`
    (``strict=False`` only). ``phases``: seconds per phase (``"locate"``, ``"verify"``,
    ``"copy"``, ``"load"``); ``seconds``: the whole call.
    """

    id: str
    step: int | None
    saved_world_size: int
    world_size: int
    names: dict[str, str]
    copied_files: int
    copied_bytes: int
    repaired_files: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    prechecked_files: int = 0

    @property
    def resharded(self) -> bool:
        return self.saved_world_size != self.world_size
