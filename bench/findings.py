"""Recorded causes of missed targets, from profiles of this code on the benchmark machine.

Keyed by ``(figure key, subject name, reference name)`` as the figures name their
comparisons; the report quotes an entry under "Missed targets" when that comparison
misses its target in a run.  An entry states what was profiled, with which tool, and
what the time goes to; it is not evidence by itself: rerun the profile after changes.
"""

from __future__ import annotations

FINDINGS: dict[tuple[str, str, str], str] = {}
