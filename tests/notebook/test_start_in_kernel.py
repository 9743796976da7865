"""``%fsdp start`` through a real Jupyter kernel and its IOPub messages (what JupyterLab
receives): the start's first line reaches the notebook within a second of the call as a
display, its phases follow in order as updates of that one display, and its last update,
what a saved notebook keeps, is the summary line; the topology table follows it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.notebook.test_kernel_output import fsdp_kernel
from tests.pool.test_start_progress import PHASES


def _start_display(message: dict[str, Any]) -> str | None:
    """The text of the start's display (or of an update of it) that ``message`` carries."""
    if message["msg_type"] not in ("display_data", "update_display_data"):
        return None
    content = message["content"]
    if not content.get("transient", {}).get("display_id", "").startswith("fsdp-interactive-start"):
        return None
    return content["data"]["text/plain"]


@pytest.mark.timing
def test_a_start_in_a_notebook_shows_its_phases_in_place_from_its_first_second():
    with fsdp_kernel() as kernel:
        # The package is imported first: the call is what is timed, not the import.
        setup = kernel.run("%load_ext fsdp_interactive\nimport fsdp_interactive.pool")
        assert not [m for m in setup if m["msg_type"] == "error"], setup
        stamped: list[tuple[float, dict[str, Any]]] = []
        called = time.monotonic()
        kernel.run(
            "%fsdp start -n 2 --devices cpu",
            on_message=lambda message: stamped.append((time.monotonic(), message)),
        )
        errors = [m for _, m in stamped if m["msg_type"] == "error"]
        assert not errors, errors
        shown = [(at, m, _start_display(m)) for at, m in stamped if _start_display(m)]
        assert shown, [m["msg_type"] for _, m in stamped]
        first_at, first, text = shown[0]
        assert first["msg_type"] == "display_data" and text.startswith(PHASES[0]), shown
        assert first_at - called < 1.0, f"the first line came {first_at - called:.2f}s after"
        assert all(m["msg_type"] == "update_display_data" for _, m, _ in shown[1:])
        texts = [text for _, _, text in shown]
        order = [next(i for i, t in enumerate(texts) if phase in t) for phase in PHASES]
        assert order == sorted(order), texts
        assert texts[-1].startswith("started 2 CPU ranks in "), texts
        # No carriage return reaches the notebook; the table follows as text.
        out = "".join(m["content"]["text"] for _, m in stamped if m["msg_type"] == "stream")
        assert "\r" not in out and "starting" not in out, out
        assert out.split()[:2] == ["rank", "local_rank"], out
