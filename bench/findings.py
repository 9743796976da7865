"""The profiled causes the report quotes, read from ``bench/findings.md``.

:func:`load` parses the Markdown file into :class:`Findings`: ``causes`` keyed by
``(figure key, subject name, reference name)`` as the figures name their comparisons,
quoted when that comparison misses its target, and ``observations`` keyed by figure key,
quoted in the figure's section whatever the outcome.  Whether every key names a
comparison that a run makes is checked against a run (``tests/bench``), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

FINDINGS_MD = Path(__file__).with_name("findings.md")
_SEPARATOR = " vs "


@dataclass
class Findings:
    causes: dict[tuple[str, str, str], str] = field(default_factory=dict)
    observations: dict[str, str] = field(default_factory=dict)


def parse(text: str, source: str = "findings.md") -> Findings:
    """Headings ``## figure: subject vs reference`` or ``## figure``, each followed by text.

    Text before the first heading is the file's own description and is skipped.  Headings
    in a row share the text after them; that text's lines are joined into one paragraph.
    A heading without text, a malformed heading or a key given twice raises ``ValueError``
    naming the line.
    """
    findings = Findings()
    pending: list[tuple[int, str]] = []
    body: list[str] = []

    def close() -> None:
        if not pending:
            return
        paragraph = " ".join(" ".join(body).split())
        if not paragraph:
            line, heading = pending[-1]
            raise ValueError(f"{source}:{line}: heading {heading!r} has no text after it")
        for line, heading in pending:
            _store(findings, heading, paragraph, f"{source}:{line}")
        pending.clear()
        body.clear()

    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("## "):
            if body and any(part.strip() for part in body):
                close()
            pending.append((number, line[3:].strip()))
        elif pending:
            body.append(line)
    close()
    return findings


def _store(findings: Findings, heading: str, text: str, where: str) -> None:
    figure, colon, comparison = heading.partition(":")
    figure = figure.strip()
    if not figure or " " in figure:
        raise ValueError(f"{where}: expected '## FIGURE' or '## FIGURE: SUBJECT vs REFERENCE'")
    if not colon:
        if figure in findings.observations:
            raise ValueError(f"{where}: a second text for figure {figure!r}")
        findings.observations[figure] = text
        return
    subject, separator, reference = comparison.strip().partition(_SEPARATOR)
    if not separator or not subject.strip() or not reference.strip():
        raise ValueError(f"{where}: expected '## {figure}: SUBJECT vs REFERENCE', got {heading!r}")
    key = (figure, subject.strip(), reference.strip())
    if key in findings.causes:
        raise ValueError(f"{where}: a second text for {figure}: {key[1]} vs {key[2]}")
    findings.causes[key] = text


def load(path: Path = FINDINGS_MD) -> Findings:
    return parse(path.read_text(encoding="utf-8"), source=path.name)
