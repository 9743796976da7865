"""The file a seal is written in: a JSON object naming its format and algorithm, with one
HMAC-SHA256 (hex) per sealed file name, the same for a snapshot's seal (the pool's key,
:mod:`._snapshot_seal`) and a disk checkpoint's (the user's key, :mod:`._owner_seal`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

ALGORITHM = "hmac-sha256"


def write(form: str, macs: Mapping[str, str], **fields: str) -> str:
    """The seal's text: ``form``, the algorithm, ``fields`` and ``macs`` by file name."""
    data = {"format": form, "algorithm": ALGORITHM, **fields, **macs}
    return json.dumps(data, indent=2, sort_keys=True)


def read(text: str, form: str, names: Iterable[str]) -> tuple[dict[str, str], dict]:
    """``(macs by file name, the whole object)`` of a seal of ``form`` sealing ``names``;
    ``ValueError`` naming what is wrong when ``text`` is not such a seal."""
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != form:
            raise ValueError(f"not a seal of the format {form!r}")
        if data.get("algorithm") != ALGORITHM:
            raise ValueError(f"algorithm {data.get('algorithm')!r}, expected {ALGORITHM!r}")
        return {name: str(data[name]) for name in names}, data
    except KeyError as exc:
        raise ValueError(f"it seals no {exc}") from None
