"""Lines of a text stream as Jupyter and a terminal show them: a carriage return rewrites
the current line.

A leaf (standard library only), shared by the pool's text printer and the notebook's
cell output: each rank's streams are cut into lines, tagged by rank, by one
:class:`RankLines`. A chunk of a stream is split into completed lines (ended by ``"\\n"``) and
the unfinished current line. Within a line, the text after a carriage return replaces
what the line showed: Jupyter's rule (also ipyparallel's and nbval's), where the whole
line is replaced rather than overwritten character by character. A carriage return at
the end of a line (``print(..., end="\\r")``) leaves the line as it is until more text
comes.

A line that was rewritten so is a *progress line* (a ``tqdm`` bar, a counter printed with
``end="\\r"``): shown in place while it changes, and in its final state once it ends.

Not done: backspaces, and ANSI cursor movement (tqdm's stacked bars with ``position=``
move the cursor up; their lines come out as separate lines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

CR = "\r"


@dataclass(frozen=True)
class Line:
    """One line as shown: ``text`` without its newline; ``rewritten``: a progress line."""

    text: str
    rewritten: bool


def shown(raw: str) -> str:
    """What a line's raw text (without ``"\\n"``) shows: the text after its last carriage
    return that more text follows."""
    body = raw.rstrip(CR)
    return body[body.rfind(CR) + 1 :]


def line_of(raw: str) -> Line:
    """``raw`` (one line's text, without ``"\\n"``) as a :class:`Line`; a carriage return
    that only ends the line (``"abc\\r"``) does not make it a progress line."""
    return Line(shown(raw), CR in raw.rstrip(CR))


def final_lines(text: str) -> list[Line]:
    """Every line of a whole stream's ``text``, the unfinished last one included."""
    if not text:
        return []
    raws = text.split("\n")
    if raws[-1] == "":
        raws.pop()
    return [line_of(raw) for raw in raws]


def final_text(text: str) -> str:
    """``text`` as it finally shows: each line in its last state (``"a\\rb\\n"`` -> ``"b\\n"``);
    a text without carriage returns is returned as it is."""
    if CR not in text:
        return text
    ends_open = not text.endswith("\n")
    body = "".join(line.text + "\n" for line in final_lines(text))
    return body[:-1] if ends_open else body


def plain_text(text: str) -> str:
    """The lines of ``text`` that are not progress lines, each ended by ``"\\n"``."""
    if CR not in text:
        return text if not text or text.endswith("\n") else text + "\n"
    return "".join(line.text + "\n" for line in final_lines(text) if not line.rewritten)


class LineBuffer:
    """One stream's text, fed in chunks: :meth:`feed` returns the lines each chunk
    completes; :meth:`current` is the unfinished line as it shows now."""

    def __init__(self) -> None:
        self._raw = ""

    def feed(self, text: str) -> list[Line]:
        if "\n" not in text:
            self._raw += text
            return []
        *done, self._raw = (self._raw + text).split("\n")
        return [line_of(raw) for raw in done]

    def feed_plain(self, text: str) -> str | None:
        """:meth:`feed` for the common chunk, one without carriage returns (with none in
        the unfinished line either): the lines it completes as one text, each ended by
        ``"\\n"`` (``""``: none). ``None`` when there is a carriage return: call
        :meth:`feed` instead (nothing was taken)."""
        if CR in text or CR in self._raw:
            return None
        end = text.rfind("\n")
        if end < 0:
            self._raw += text
            return ""
        done = self._raw + text[: end + 1]
        self._raw = text[end + 1 :]
        return done

    def current(self) -> Line | None:
        """The unfinished line (``None`` when there is none); it is ``rewritten`` as soon as
        it holds a carriage return, a trailing one included (``end="\\r"`` counters)."""
        if not self._raw:
            return None
        return Line(shown(self._raw), CR in self._raw)

    def flush(self) -> Line | None:
        """The unfinished line as a finished one (``None``: none); the buffer is then empty."""
        line = self.current()
        self._raw = ""
        return line


def rank_tag(rank: int, stream: str) -> str:
    """The prefix a line of ``rank``'s ``stream`` is shown with: ``[rank 1] `` for stdout,
    ``[rank 1:stderr] `` otherwise."""
    return f"[rank {rank}] " if stream == "stdout" else f"[rank {rank}:{stream}] "


class LineSurface(Protocol):
    """Where lines are shown (:class:`._status_line.StatusLines`, a cell's live output):
    ordinary text, and lines under keys that move in place until they end."""

    def write(self, stream: str, text: str) -> None: ...
    def update(self, key: Any, stream: str, text: str) -> None: ...
    def end(self, key: Any, stream: str, text: str | None) -> None: ...


class RankLines:
    """Every rank's streams, fed chunk by chunk as the ranks wrote them, shown as lines.

    The one line splitter of the rank output, for the pool's printer
    (:class:`pool.TaggedPrinter`) and a ``%%fsdp`` cell's live output alike. Each stream
    of each rank is cut into lines (:class:`LineBuffer`); complete lines go to
    ``lines(rank, stream, text, progress)`` (``text``: untagged lines, each ended by
    ``"\\n"``; ``progress``: one progress line that ended, a ``tqdm`` bar's last state;
    default: written to the surface, tagged), in the rank's order. A progress line that is
    still being rewritten moves in place on ``surface`` under the key ``(rank, "line",
    stream)``, tagged (when ``moves(rank, stream)``; otherwise it is shown once it ends),
    and ends there in its final state. ``tagged``: lines carry :func:`rank_tag`.
    """

    def __init__(
        self,
        surface: LineSurface,
        *,
        tagged: bool = True,
        moves: Callable[[int, str], bool] = lambda rank, stream: True,
        lines: Callable[[int, str, str, bool], None] | None = None,
    ) -> None:
        self._surface = surface
        self._tagged = tagged
        self._moves = moves
        self._lines = lines or self._write_tagged
        self._line_buffers: dict[tuple[int, str], LineBuffer] = {}
        self._moving: set[tuple[int, str]] = set()

    def tag(self, rank: int, stream: str) -> str:
        return rank_tag(rank, stream) if self._tagged else ""

    def _write_tagged(self, rank: int, stream: str, text: str, progress: bool) -> None:
        tag = self.tag(rank, stream)
        self._surface.write(stream, "".join(f"{tag}{line}\n" for line in text.split("\n")[:-1]))

    def feed(self, rank: int, stream: str, text: str) -> None:
        """A chunk of ``rank``'s ``stream`` (carriage returns included)."""
        key = (rank, stream)
        buffer = self._line_buffers.setdefault(key, LineBuffer())
        done = buffer.feed_plain(text) if key not in self._moving else None
        if done is not None:  # the common chunk: whole lines, no carriage return
            if done:
                self._lines(rank, stream, done, False)
            return
        plain: list[str] = []
        for line in buffer.feed(text):
            if key in self._moving:
                self._moving.discard(key)
                self._surface.end(
                    (rank, "line", stream), stream, self.tag(rank, stream) + line.text
                )
            elif line.rewritten:  # a progress line that ended before it was seen moving
                self._show(rank, stream, plain)
                self._lines(rank, stream, line.text + "\n", True)
            else:
                plain.append(line.text)
        self._show(rank, stream, plain)
        current = buffer.current()
        if current is not None and current.rewritten and self._moves(rank, stream):
            self._moving.add(key)
            self._surface.update(
                (rank, "line", stream), stream, self.tag(rank, stream) + current.text
            )

    def _show(self, rank: int, stream: str, plain: list[str]) -> None:
        """Hand on complete lines that are not progress lines (and forget them)."""
        if plain:
            self._lines(rank, stream, "".join(f"{line}\n" for line in plain), False)
            plain.clear()

    def flush(self, note: str | None = None) -> None:
        """The streams ended: every unfinished line is shown as a finished one, a moving
        one in its last state (``note``: added to it, ``  [note]``)."""
        for key in sorted(self._line_buffers):
            rank, stream = key
            line = self._line_buffers[key].flush()
            if key in self._moving:
                self._moving.discard(key)
                text = self.tag(rank, stream) + line.text if line is not None else None
                if text is not None and note is not None:
                    text += f"  [{note}]"
                self._surface.end((rank, "line", stream), stream, text)
            elif line is not None:
                self._lines(rank, stream, line.text + "\n", line.rewritten)
