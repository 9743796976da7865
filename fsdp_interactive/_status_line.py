"""Lines that move in place on a text stream, drawn the way ``tqdm`` draws its bar.

A leaf (standard library only). On a text stream (a terminal, a file, a plain script's
output) one line can be rewritten in place: the last one, with a carriage return.
:class:`StatusLines` keeps that line for live lines (progress lines and bars of the
ranks, each under a key), writes ordinary text above it (clearing the line first and
drawing it again after, as ``tqdm.write`` does), and writes each live line's final text
as an ordinary line when it ends.

Several live lines may be open at once (one per rank, say); one line can move, so only
the lowest key's is drawn, the others show when they end. Not done: stacking several
moving lines with cursor movement (which files and Jupyter streams do not understand).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TextIO

Key = Hashable


class StatusLines:
    """Live lines under keys, drawn one at a time on ``file_of(stream)``'s last line.

    ``update(key, stream, text)`` sets a live line's text (``stream``: "stdout" or
    "stderr", where it is drawn); ``end(key, stream, text)`` ends it, writing ``text`` to
    ``stream`` (``None``: nothing, a bar that leaves no trace); ``write(stream, text)``
    writes ordinary text, ``above(show)`` lets ``show()`` write it; ``close()`` ends every live line with its last text.
    Keys must be comparable with one another (the lowest is drawn).
    """

    def __init__(self, file_of: Callable[[str], TextIO]) -> None:
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
