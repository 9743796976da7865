"""Lines drawn in place: on a text stream's last line, or as a Jupyter display.

A leaf (standard library only; IPython imported where a display is published), the one
in-place surface of the rank output the pool prints (:class:`pool.TaggedPrinter`), of a
``%%fsdp`` cell's live output outside a kernel, and of the start's and a recovery's
phase line.

On a text stream (a terminal, a file, a plain script's output) one line can be rewritten
in place, the way ``tqdm`` draws its bar: the last one, with a carriage return.
:class:`StatusLines` keeps that line for live lines (progress lines and bars of the
ranks, a hang notice, a phase line, each under a key), writes ordinary text above it
(clearing the line first and drawing it again after, as ``tqdm.write`` does), and writes
each live line's final text as an ordinary line when it ends. Several live lines may be
open at once (one per rank, say); one line can move, so only the lowest key's is drawn,
the others show when they end.

In a Jupyter kernel a line moves in place as one ``text/plain`` display updated by its
display id (:class:`DisplayLine`); what a saved notebook keeps is its last update.

Not done: stacking several moving lines with cursor movement (which files and Jupyter
streams do not understand).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Hashable
from typing import Any, Protocol, TextIO

Key = Hashable


class Bar(Protocol):
    """A progress bar's state as drawn on a text line (:class:`._bar_state.BarState`)."""

    text: str
    closed: bool
    leave: bool


def standard_stream(name: str) -> TextIO:
    """The current ``sys.stderr`` for ``"stderr"``, ``sys.stdout`` for any other name."""
    return sys.stderr if name == "stderr" else sys.stdout


class StatusLines:
    """Live lines under keys, drawn one at a time on ``file_of(stream)``'s last line
    (default: the current ``sys.stdout`` and ``sys.stderr``).

    ``update(key, stream, text)`` sets a live line's text (``stream``: "stdout" or
    "stderr", where it is drawn); ``end(key, stream, text)`` ends it, writing ``text`` to
    ``stream`` (``None``: nothing, a bar that leaves no trace); ``bar(key, tag, state)``
    draws a progress bar's state on stderr, ``tag`` first; ``write(stream, text)`` writes
    ordinary text, ``above(show)`` lets ``show()`` write it; ``close()`` ends every live
    line with its last text. Keys must be comparable with one another (the lowest is
    drawn).
    """

    def __init__(self, file_of: Callable[[str], TextIO] = standard_stream) -> None:
        self._file_of = file_of
        self._live: dict[Any, tuple[str, str]] = {}  # key -> (stream, text)
        self._drawn: tuple[Any, str, int] | None = None  # key, stream, width drawn
        self._drawn_text = ""

    def update(self, key: Key, stream: str, text: str) -> None:
        self._live[key] = (stream, text)
        self._draw()

    def end(self, key: Key, stream: str, text: str | None) -> None:
        self._live.pop(key, None)
        if self._drawn is not None and self._drawn[0] == key:
            self._erase()
        if text is not None:
            self.write(stream, text + "\n")
        else:
            self._draw()

    def bar(self, key: Key, tag: str, state: Bar) -> None:
        """A bar's state: drawn in place while open; once closed, its last text stays as
        an ordinary line (or nothing, for a bar that leaves no trace)."""
        text = tag + state.text
        if state.closed:
            self.end(key, "stderr", text if state.leave else None)
        else:
            self.update(key, "stderr", text)

    def write(self, stream: str, text: str) -> None:
        if not text:
            return

        def write() -> None:
            out = self._file_of(stream)
            out.write(text)
            out.flush()

        self.above(write)

    def above(self, show: Callable[[], None]) -> None:
        """Run ``show`` (which writes ordinary output) with the moving line out of its way."""
        self._erase()
        show()
        self._draw()

    def close(self) -> None:
        for key in sorted(self._live):
            stream, text = self._live[key]
            self.end(key, stream, text)

    def _draw(self) -> None:
        if not self._live:
            return
        key = min(self._live)
        stream, text = self._live[key]
        if self._drawn is not None and self._drawn[0] == key and self._drawn_text == text:
            return
        if self._drawn is not None and self._drawn[0] != key:
            self._erase()
        width = self._drawn[2] if self._drawn is not None else 0
        out = self._file_of(stream)
        out.write("\r" + text + " " * max(width - len(text), 0))
        out.flush()
        self._drawn = (key, stream, max(width, len(text)))
        self._drawn_text = text

    def _erase(self) -> None:
        if self._drawn is None:
            return
        _, stream, width = self._drawn
        out = self._file_of(stream)
        out.write("\r" + " " * width + "\r")
        out.flush()
        self._drawn = None


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (a front end that shows display updates)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def new_display_id(kind: str = "") -> str:
    """A display id of this package's, ``fsdp-interactive-<kind>-<unique>``."""
    return f"fsdp-interactive-{kind + '-' if kind else ''}{uuid.uuid4().hex}"


class DisplayLine:
    """One ``text/plain`` display of a Jupyter kernel, updated in place: published at the
    first :meth:`show` (``text``: at once), its display id ``fsdp-interactive-<kind>-...``."""

    def __init__(self, text: str | None = None, kind: str = "") -> None:
        self.display_id = new_display_id(kind)
        self.text: str | None = None
        if text is not None:
            self.show(text)

    def show(self, text: str) -> None:
        if text == self.text:
            return
        from IPython.display import publish_display_data

        update = self.text is not None
        self.text = text
        publish_display_data(
            {"text/plain": text}, transient={"display_id": self.display_id}, update=update
        )
