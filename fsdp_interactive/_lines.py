"""Lines of a text stream as Jupyter and a terminal show them: a carriage return rewrites
the current line.

A leaf (standard library only), shared by the pool's text printer and the notebook's
cell output. A chunk of a stream is split into completed lines (ended by ``"\\n"``) and
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

from dataclasses import dataclass

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
