"""The progress bar ``tqdm.auto`` gives on a rank: its states go to the notebook, which
draws them.

Rank side; imports ``tqdm`` (only :mod:`._tqdm_auto` imports this module, once ``tqdm``
is being imported anyway). Every engine is an IPython kernel, so ``tqdm.auto`` would pick
``tqdm.notebook``, whose widget lives in the engine and reaches the notebook only as a
display at the end of the call. :func:`bar_class` makes the class ``tqdm.auto`` gives here
instead: a ``tqdm.std.tqdm`` that draws nothing itself and publishes each state it would
draw (``display()``, at ``tqdm``'s own pace: ``mininterval``, ``miniters``, ``delay``) as
a display under :data:`fsdp_interactive._bar_state.MIME`, updated in place by its
display id. The notebook draws it: a widget bar in a Jupyter kernel, a moving text line
elsewhere. As with ``tqdm.notebook``, a bar closed before its total, or whose loop
raised, ends in the "danger" style; ``clear()`` does nothing.

Not done: ``position=`` (each bar is its own display anyway), ``tqdm.notebook`` imported
by name (it keeps its own widget).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from tqdm.std import tqdm as std_tqdm

from fsdp_interactive._bar_state import MIME, BarState

#: ``publish(data, display_id, update)``: send one display (or an update of it).
Publish = Callable[[dict[str, Any], str, bool], None]

_BAR_MARK = "<bar/>"
_AROUND_BAR = re.compile(r"\|?<bar/>\|?")


def bar_class(publish: Publish) -> type:
    """A ``tqdm`` class whose bars publish their states through ``publish``."""

    class RankBar(_RankBar):
        _publish = staticmethod(publish)

    return RankBar


class _RankBar(std_tqdm):
    """``tqdm.std.tqdm`` in "gui" mode (it draws nothing) whose ``display`` publishes."""

    _publish: Publish

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs = dict(kwargs)
        kwargs.pop("display", None)  # tqdm.notebook's option: show at once (always done)
        kwargs["gui"] = True
        # tqdm disables a bar on a non-terminal file when disable=None; the notebook shows it
        kwargs["disable"] = bool(kwargs.get("disable", False))
        self._display_id = f"fsdp-interactive-bar-{uuid.uuid4().hex}"
        self._published = False
        self._style = ""
        super().__init__(*args, **kwargs)
        if not self.disable and self.delay <= 0:
            self.display()

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Publish the bar's state (``msg``/``pos``: tqdm's; the state says everything)."""
        self._send(closed=False)
        return True

    def _send(self, closed: bool) -> None:
        state = self._state(closed)
        data = {"text/plain": state.text, MIME: state.to_wire()}
        self._publish(data, self._display_id, self._published)
        self._published = True

    def _state(self, closed: bool) -> BarState:
        values = self.format_dict
        text = self.format_meter(**values)
        values["bar_format"] = (values["bar_format"] or "{l_bar}{bar}{r_bar}").replace(
            "{bar}", _BAR_MARK
        )
        marked = self.format_meter(**values)
        if _BAR_MARK in marked:
            left, right = _AROUND_BAR.split(marked, maxsplit=1)
        else:
            left, right = "", marked
        leave = bool(self.leave) if self.leave is not None else self.pos == 0
        return BarState(
            n=float(self.n),
            total=None if self.total is None else float(self.total),
            left=left,
            right=right,
            text=text,
            style=self._style,
            closed=closed,
            leave=leave,
        )

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from super().__iter__()
        except BaseException:
            self._fail()
            raise

    def update(self, n: float = 1) -> bool | None:
        try:
            return super().update(n)
        except BaseException:
            self._fail()
            raise

    def _fail(self) -> None:
        self._style = "danger"
        if self._published:
            self._send(closed=False)

    def close(self) -> None:
        if self.disable:
            return
        super().close()  # "gui" mode: bookkeeping only, nothing drawn
        if not self._published:
            return  # never shown (its ``delay`` had not passed): nothing to end
        if self._style != "danger":
            stopped_early = self.total is not None and self.n < self.total
            self._style = "danger" if stopped_early else "success"
        self._send(closed=True)

    def clear(self, *_: Any, **__: Any) -> None:
        """Nothing to clear: the bar is drawn in the notebook."""

    def reset(self, total: float | None = None) -> None:
        self._style = ""
        super().reset(total=total)
