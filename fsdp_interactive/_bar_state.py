"""A rank's progress bar as plain data: what ``tqdm.auto`` on a rank sends to the kernel.

A leaf (standard library only), shared by the rank side (which publishes a bar's state
as a display under :data:`MIME`, updated in place by its display id) and the notebook
side (which draws it: a widget in a Jupyter kernel, a moving text line elsewhere).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: The MIME type of a bar's state in the display messages a rank publishes; their
#: ``text/plain`` is the bar as text (:attr:`BarState.text`).
MIME = "application/vnd.fsdp-interactive.progress+json"

#: ``style`` values, as ipywidgets names bar styles: running, finished, stopped early.
STYLES = ("", "success", "danger", "info")


@dataclass(frozen=True)
class BarState:
    """One state of a bar.

    ``n``/``total``: iterations done and expected (``total`` ``None``: unknown);
    ``left``/``right``: the text before and after the bar (description and percentage;
    counts, times and rate); ``text``: the whole bar as text, as ``tqdm`` prints it;
    ``style``: one of :data:`STYLES`; ``closed``: the bar ended; ``leave``: its last
    state stays shown after it ended.
    """

    n: float
    total: float | None
    left: str
    right: str
    text: str
    style: str = ""
    closed: bool = False
    leave: bool = True

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> BarState | None:
        """The state in a display's ``data[MIME]`` (``None`` when it is not one)."""
        if not isinstance(data, dict):
            return None
        try:
            state = cls(
                n=float(data["n"]),
                total=None if data.get("total") is None else float(data["total"]),
                left=str(data.get("left", "")),
                right=str(data.get("right", "")),
                text=str(data.get("text", "")),
                style=str(data.get("style", "")),
                closed=bool(data.get("closed", False)),
                leave=bool(data.get("leave", True)),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return state if state.style in STYLES else None


def bar_of(bundle: Any) -> BarState | None:
    """The bar state a display's MIME bundle carries, if it is a bar's."""
    if not isinstance(bundle, dict) or MIME not in bundle:
        return None
    return BarState.from_wire(bundle[MIME])
