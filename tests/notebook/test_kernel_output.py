"""What the ranks show in a ``%%fsdp`` cell, through a real Jupyter kernel and its IOPub
messages (what JupyterLab receives) against a real 2-rank pool: a plain ``tqdm`` bar is
one display updated in place while the cell runs, each rank's with ``--group-outputs
rank``; a ``tqdm.auto`` bar is a widget bar drawn in the kernel from the rank's states;
and a notebook executed with nbclient stores each bar once, in its final state."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from tests.notebook.gates import Gates, gated_loop, held_until, one_sided_barrier

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
WIDGET = "application/vnd.jupyter.widget-view+json"


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("IPP_NONINTERACTIVE", None)  # the ranks' output streams, as in a live notebook
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class Kernel:
    """A started kernel: ``run(code, on_message)`` executes and returns its IOPub messages."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def run(self, code: str, on_message=None, timeout: float = 300) -> list[dict[str, Any]]:
        msg_id = self.client.execute(code)
        messages = []
        end = time.monotonic() + timeout
        while True:
            try:
                message = self.client.get_iopub_msg(timeout=max(end - time.monotonic(), 0.1))
            except queue.Empty:
                raise AssertionError(f"no end of {code!r} within {timeout}s") from None
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "status" and content["execution_state"] == "idle":
                return messages
            messages.append(message)
            if on_message is not None:
                on_message(message)


@contextlib.contextmanager
def fsdp_kernel() -> Iterator[Kernel]:
    """A started kernel; ``%fsdp stop`` is run and the kernel shut down at the end."""
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(REPO), env=_kernel_env())
    try:
        yield Kernel(client)
    finally:
        try:
            Kernel(client).run("%fsdp stop", timeout=120)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=False)


@contextlib.contextmanager
def pool_kernel(start: str = "-n 2 --backend gloo") -> Iterator[Kernel]:
    """A started kernel with the extension loaded and ``%fsdp start START`` run; the pool
    is stopped and the kernel shut down at the end."""
    with fsdp_kernel() as kernel:
        errors = [
            m
            for m in kernel.run(f"%load_ext fsdp_interactive\n%fsdp start {start}")
            if m["msg_type"] == "error"
        ]
        assert not errors, errors
        yield kernel


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    with pool_kernel() as started:
        yield started


def _text_displays(messages: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Display id -> the ``text/plain`` of its display and of each update, in order."""
    shown: dict[str, list[str]] = {}
    for message in messages:
        if message["msg_type"] in ("display_data", "update_display_data"):
            display_id = message["content"].get("transient", {}).get("display_id")
            if display_id is not None:
                shown.setdefault(display_id, []).append(message["content"]["data"]["text/plain"])
    return shown


def _gated_run(kernel: Kernel, tmp_path: Path, line: str, bar: str, watch) -> tuple[Gates, list]:
    """Run a gated loop; ``watch(gates, message)`` opens gates from what the kernel sends."""
    gates = Gates(tmp_path, STEPS)
    try:
        messages = kernel.run(
            f"%%fsdp {line}\n" + gated_loop(tmp_path, STEPS, bar),
            on_message=lambda message: watch(gates, message),
        )
    finally:
        gates.close()
    return gates, messages


def _watch_displays(*tags: str):
    """Open gate ``i`` once the display of each ``tag``'s bar shows step ``i``."""
    latest: dict[str, str] = {}

    def watch(gates: Gates, message: dict[str, Any]) -> None:
        if message["msg_type"] not in ("display_data", "update_display_data"):
            return
        text = message["content"]["data"].get("text/plain", "")
        for tag in tags:
            if text.startswith(tag):
                latest[tag] = text
        if len(latest) == len(tags):
            steps = [int(re.search(r"(\d+)/\d+", t).group(1)) for t in latest.values()]
            gates.observe(f"{min(steps)}/{STEPS}")

    return watch


@pytest.mark.timing
def test_a_plain_bar_is_one_display_updated_while_the_cell_runs(kernel, tmp_path):
    kernel.run("%%fsdp\nfrom tqdm import tqdm")
    gates, messages = _gated_run(
        kernel,
        tmp_path,
        "",
        "tqdm(RANGE, desc=f'plain of rank {rank}', mininterval=0)",
        _watch_displays("plain of rank 0"),
    )
    assert gates.opened_by_sight == list(range(STEPS))
    shown = _text_displays(messages)
    assert len(shown) == 1, shown  # rank 0's bar only, untagged
    (states,) = shown.values()
    assert [s.split("|")[0] for s in states[:2]] == [
        "plain of rank 0:   0%",
        "plain of rank 0:  25%",
    ]
    assert states[-1].startswith(f"plain of rank 0: 100%|██████████| {STEPS}/{STEPS} ")
    streams = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert "plain of rank" not in streams and "\r" not in streams


@pytest.mark.timing
def test_with_group_outputs_rank_each_ranks_bar_is_its_own_display(kernel, tmp_path):
    kernel.run("%%fsdp\nfrom tqdm import tqdm")
    gates, messages = _gated_run(
        kernel,
        tmp_path,
        "--group-outputs rank",
        "tqdm(RANGE, desc=f'bar of rank {rank}', mininterval=0)",
        _watch_displays("[rank 0:stderr] bar of rank 0", "[rank 1:stderr] bar of rank 1"),
    )
    assert gates.opened_by_sight == list(range(STEPS))
    shown = _text_displays(messages)
    assert len(shown) == 2, shown
    finals = sorted(states[-1] for states in shown.values())
    for rank, final in enumerate(finals):
        assert final.startswith(f"[rank {rank}:stderr] bar of rank {rank}: 100%|██████████| 4/4 ")


@pytest.mark.timing
def test_a_tqdm_auto_bar_is_a_widget_bar_drawn_in_the_kernel_while_the_cell_runs(kernel, tmp_path):
    kernel.run("%%fsdp\nfrom tqdm.auto import tqdm as auto_tqdm")

    def watch(gates: Gates, message: dict[str, Any]) -> None:
        if message["msg_type"] == "comm_msg":  # the widget's state, set in the kernel
            state = message["content"]["data"].get("state", {})
            gates.observe(" ".join(str(value) for value in state.values()))

    gates, messages = _gated_run(
        kernel,
        tmp_path,
        "",
        "auto_tqdm(RANGE, desc=f'auto of rank {rank}', mininterval=0)",
        watch,
    )
    assert gates.opened_by_sight == list(range(STEPS))
    bars = [
        m["content"]
        for m in messages
        if m["msg_type"] in ("display_data", "update_display_data")
        and WIDGET in m["content"]["data"]
    ]
    assert {bar["transient"]["display_id"] for bar in bars} == {bars[0]["transient"]["display_id"]}
    assert bars[0]["data"]["text/plain"].startswith("auto of rank 0:   0%")
    assert bars[-1]["data"]["text/plain"].startswith("auto of rank 0: 100%|██████████| 4/4 ")
    values = [
        m["content"]["data"]["state"]["value"]
        for m in messages
        if m["msg_type"] == "comm_msg"
        and isinstance(m["content"]["data"].get("state", {}).get("value"), float)
    ]
    assert values == [float(step) for step in range(1, STEPS + 1)]
    styles = [
        m["content"]["data"]["state"]["bar_style"]
        for m in messages
        if m["msg_type"] == "comm_msg" and "bar_style" in m["content"]["data"].get("state", {})
    ]
    assert styles[-1] == "success"


def test_a_notebook_run_by_nbclient_stores_each_bar_once_in_its_final_state(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(source)
        for source in (
            "%load_ext fsdp_interactive\n%fsdp start -n 2 --backend gloo",
            "%%fsdp\nfrom tqdm import tqdm\nimport time\n"
            "for _ in tqdm(range(6), desc='plain', mininterval=0):\n    time.sleep(0.05)\n"
            "for i in range(3):\n    print(f'count {i}', end='\\r', flush=True)\n"
            "    time.sleep(0.2)\nprint('counted')",
            "%%fsdp --group-outputs rank\nfrom tqdm.auto import tqdm\nimport time\n"
            "for _ in tqdm(range(6), desc=f'auto {rank}', mininterval=0):\n    time.sleep(0.05)",
            "%fsdp stop",
        )
    ]
    notebook.metadata["kernelspec"] = {"name": "python3", "language": "python"}
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(REPO)}}
    )
    client.execute(env=_kernel_env())
    nbformat.write(notebook, tmp_path / "saved.ipynb")
    saved_cells = nbformat.read(tmp_path / "saved.ipynb", as_version=4).cells

    plain = saved_cells[1].outputs
    # the bar, then the counter's line, which 'counted' finally overwrote
    assert [o["output_type"] for o in plain] == ["display_data", "display_data"], plain
    assert plain[0]["data"]["text/plain"].startswith("plain: 100%|██████████| 6/6 ")
    assert plain[1]["data"]["text/plain"] == "counted"

    auto = [o for o in saved_cells[2].outputs if o["output_type"] == "display_data"]
    assert sorted(o["data"]["text/plain"].split(":")[0] for o in auto) == [
        "[rank 0] auto 0",
        "[rank 1] auto 1",
    ]
    for output in auto:
        assert "100%|██████████| 6/6 " in output["data"]["text/plain"]
        assert WIDGET in output["data"]
    texts = "".join(o.get("text", "") for cell in saved_cells for o in cell.outputs)
    assert "\r" not in texts


@pytest.mark.timing
def test_a_hang_notice_is_one_display_shown_while_rank_0_waits_and_emptied_when_it_moves_on(
    kernel, tmp_path
):
    arrive, released = tmp_path / "arrive", tmp_path / "released"
    opened: list[str] = []

    def watch(message: dict[str, Any]) -> None:
        if message["msg_type"] not in ("display_data", "update_display_data"):
            return
        text = message["content"]["data"].get("text/plain", "")
        if not opened and text.startswith("possible hang"):
            opened.append("arrive")
            arrive.touch()
        elif opened == ["arrive"] and text == "":
            opened.append("released")
            released.touch()

    fallback = threading.Timer(120, lambda: (arrive.touch(), released.touch()))
    fallback.start()
    try:
        messages = kernel.run(
            "%%fsdp --hang-notice 2\n" + one_sided_barrier(arrive, then=held_until(released)),
            on_message=watch,
        )
    finally:
        fallback.cancel()
        arrive.touch()
        released.touch()
    assert not [m for m in messages if m["msg_type"] == "error"], messages
    # The notice came, then went while rank 0 still ran (it moved on past the barrier).
    assert opened == ["arrive", "released"]
    notices = [s for s in _text_displays(messages).values() if s[0].startswith("possible hang")]
    assert len(notices) == 1, notices
    [states] = notices
    assert states[-1] == ""
    first = states[0]
    waited = re.match(r"possible hang: rank 0 has waited (\d+) s in barrier #\d+ ", first)
    assert waited and 2 <= int(waited.group(1)) <= 4, first
    assert re.search(
        r"\(Cell In\[\d+\], line 8: dist\.barrier\(\)\); rank 1 finished the cell", first
    )
    assert first.endswith("then type %fsdp trace.")
