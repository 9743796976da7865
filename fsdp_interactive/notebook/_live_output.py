"""Where a ``%%fsdp`` cell shows what moves while it runs: progress lines, bars, displays.

Notebook side. Two surfaces, chosen by where the kernel runs (:func:`live_output`):

* :class:`KernelLiveOutput`, in a Jupyter kernel: each moving line (a line a rank
  rewrites with carriage returns, such as a plain ``tqdm`` bar) is one ``display_data``
  output of ``text/plain``, updated in place by its display id; each ``tqdm.auto`` bar
  of a rank is an ipywidgets bar (description, progress, counts) drawn here and set
  from the states the rank sends, shown as a display whose ``text/plain`` is the bar as
  text. A display's last update is what a saved notebook keeps (``update_display_data``
  replaces the stored output), so it holds each bar's final state, not its updates.
* :class:`TextLiveOutput`, anywhere else (a terminal IPython, a script): the moving
  lines and bars of the ranks are drawn on the stream's last line with a carriage
  return, one at a time: :class:`fsdp_interactive._status_line.StatusLines`, the surface
  the pool prints its rank output on.

Both take ordinary text through ``write`` (so that a text surface can keep its moving
line below it) and a rank's displays through ``rich`` (shown at once; a rank's update
of a display it showed updates it here). Not done: ``clear_output`` from a rank.
"""

from __future__ import annotations

import html
from collections.abc import Hashable
from typing import Any

from fsdp_interactive._bar_state import BarState
from fsdp_interactive._status_line import (
    DisplayLine,
    StatusLines,
    in_kernel,
    new_display_id,
    standard_stream,
)

Key = Hashable


def _publish(data: dict[str, Any], display_id: str, update: bool) -> None:
    from IPython.display import publish_display_data

    publish_display_data(data=data, transient={"display_id": display_id}, update=update)


def _write(name: str, text: str) -> None:
    out = standard_stream(name)
    out.write(text)
    out.flush()


def _html(text: str) -> str:
    # Figure spaces keep the bar's padding, which HTML would fold (as tqdm.notebook does).
    return html.escape(text).replace(" ", "\u2007")


class WidgetBar:
    """A rank's ``tqdm.auto`` bar, drawn as ipywidgets in the kernel and shown as one
    display (``text/plain``: the bar as text, ``tag`` first)."""

    def __init__(self, tag: str, state: BarState) -> None:
        import ipywidgets

        self.tag = tag
        self.display_id = new_display_id()
        self._left = ipywidgets.HTML()
        self._bar = ipywidgets.FloatProgress(min=0, max=1)
        self._right = ipywidgets.HTML()
        self.box = ipywidgets.HBox([self._left, self._bar, self._right])
        self._set(state)
        _publish(self._bundle(state), self.display_id, update=False)

    def _bundle(self, state: BarState) -> dict[str, Any]:
        text = f"{self.tag}{state.text}" if state.leave or not state.closed else ""
        return {
            "text/plain": text,
            "application/vnd.jupyter.widget-view+json": {
                "version_major": 2,
                "version_minor": 0,
                "model_id": self.box.model_id,
            },
        }

    def _set(self, state: BarState) -> None:
        self.last = state
        if state.total:
            self._bar.max = state.total
            self._bar.value = min(state.n, state.total)
            self._bar.bar_style = state.style
        else:  # an unknown total: a full bar in the "info" style, as tqdm.notebook draws it
            self._bar.value = self._bar.max = 1
            self._bar.bar_style = state.style or "info"
        self._left.value = _html(self.tag + state.left)
        self._right.value = _html(state.right)
        if state.closed and not state.leave:
            self.box.layout.display = "none"

    def update(self, state: BarState) -> None:
        self._set(state)
        if state.closed:
            self.save()

    def save(self) -> None:
        """Give the display the bar's text as it is now (a saved notebook keeps it)."""
        _publish(self._bundle(self.last), self.display_id, update=True)


class KernelLiveOutput:
    """Moving lines and bars as displays updated in place (in a Jupyter kernel)."""

    def __init__(self) -> None:
        self._lines: dict[Key, DisplayLine] = {}
        self._bars: dict[Key, WidgetBar] = {}
        self._shown: dict[tuple[int, str], str] = {}  # (rank, its display id) -> ours

    def write(self, name: str, text: str) -> None:
        if text:
            _write(name, text)

    def update(self, key: Key, stream: str, text: str) -> None:
        shown = self._lines.get(key)
        if shown is None:
            self._lines[key] = DisplayLine(text)
        else:
            shown.show(text)

    def end(self, key: Key, stream: str, text: str | None) -> None:
        shown = self._lines.pop(key, None)
        if shown is not None:
            shown.show(text or "")
        elif text is not None:
            _write(stream, text + "\n")

    def bar(self, key: Key, tag: str, state: BarState) -> None:
        shown = self._bars.get(key)
        if shown is None:
            shown = self._bars[key] = WidgetBar(tag, state)
        else:
            shown.update(state)
        if state.closed:
            del self._bars[key]

    def rich(
        self, rank: int, content: dict[str, Any], display_id: str | None, update: bool
    ) -> None:
        """Show a rank's display (``content``: data and metadata), or update the one it
        showed under ``display_id``; an update of a display not shown here is dropped."""
        from IPython.display import publish_display_data

        if display_id is None:
            publish_display_data(data=content["data"], metadata=content.get("metadata"))
            return
        ours = self._shown.get((rank, display_id))
        if update and ours is None:
            return
        if ours is None:
            ours = self._shown[(rank, display_id)] = new_display_id()
        publish_display_data(
            data=content["data"],
            metadata=content.get("metadata"),
            transient={"display_id": ours},
            update=update,
        )

    def close(self) -> None:
        """Moving lines stay in their last state; an open bar gets its last text saved."""
        self._lines.clear()
        for bar in self._bars.values():
            bar.save()
        self._bars.clear()


class TextLiveOutput(StatusLines):
    """Moving lines and bars on the streams' last line (a terminal, a script): the pool's
    in-place surface, which also shows a rank's displays above its moving line."""

    def rich(
        self, rank: int, content: dict[str, Any], display_id: str | None, update: bool
    ) -> None:
        from IPython.display import publish_display_data

        self.above(
            lambda: publish_display_data(data=content["data"], metadata=content.get("metadata"))
        )


LiveOutput = KernelLiveOutput | TextLiveOutput


def live_output() -> LiveOutput:
    """The surface for this kernel: displays in a Jupyter kernel, text elsewhere."""
    return KernelLiveOutput() if in_kernel() else TextLiveOutput()
