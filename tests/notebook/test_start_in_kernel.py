"""``%fsdp start`` through a real Jupyter kernel and its IOPub messages (what JupyterLab
receives): the start's first line reaches the notebook within a second of the call, its
phases follow in order on one line rewritten in place, and what the notebook keeps of
that line is the summary, above the topology table."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel

from fsdp_interactive._lines import final_text
from tests.notebook.test_kernel_output import Kernel, _kernel_env
from tests.pool.test_start_progress import PHASES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timing
def test_a_start_in_a_notebook_shows_its_phases_in_place_from_its_first_second():
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(REPO), env=_kernel_env())
    kernel = Kernel(client)
    try:
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
        out = [
            (at, m["content"]["text"])
            for at, m in stamped
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        ]
        assert out, stamped
        first_at, first = out[0]
        assert first.lstrip("\r").startswith(PHASES[0]), out
        assert first_at - called < 1.0, f"the first line came {first_at - called:.2f}s after"
        text = "".join(chunk for _, chunk in out)
        positions = [text.index(phase) for phase in PHASES]
        assert positions == sorted(positions), text
        # A notebook rewrites the line at each carriage return: it keeps the summary.
        shown = final_text(text).splitlines()
        assert shown[0].startswith("started 2 CPU ranks in "), shown
        assert shown[1].split()[:2] == ["rank", "local_rank"], shown
    finally:
        try:
            kernel.run("%fsdp stop", timeout=120)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)
