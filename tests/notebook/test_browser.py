"""JupyterLab in headless Chromium: run the layout and grad-norm widgets, check the DOM,
answer a rank's breakpoint through the notebook's input box, and watch a rank's
``tqdm.auto`` bar and a plain ``tqdm`` bar move while their cell runs.

Needs Debian's ``chromium`` (``apt-get install chromium``), ``jupyterlab`` and
``playwright`` (both in the ``dev`` extra); without them the test is skipped with the
reason, unless ``FSDPI_REQUIRE_BROWSER=1`` (set by CI, which installs Chromium) makes that
a failure.
The JupyterLab server is started and stopped by this test (by its handle); the notebook
stops its own pool in its last cell, and the kernel's exit stops it otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.notebook.gates import gated_loop, held_until

pytestmark = pytest.mark.timing

CHROMIUM = (
    os.environ.get("FSDPI_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
)
REPO = Path(__file__).resolve().parents[2]

CELLS = [
    "%load_ext fsdp_interactive",
    "%fsdp start -n 2 --backend gloo",
    "%%fsdp --no-stream\n"
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "from torch.distributed.fsdp import fully_shard\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))\n"
    "fully_shard(model, mesh=init_device_mesh('cpu', (world_size,)))\n"
    "model(torch.randn(4, 6)).square().sum().backward()",
    "from fsdp_interactive.notebook import GradNormView, LayoutView, RankModel, current_pool\n"
    "source = RankModel(current_pool(), 'model')\n"
    "LayoutView(source)",
    "GradNormView(source)",
    # A Llama-sized parameter count (305): the views must group it by FSDP unit.
    "%%fsdp --no-stream\n"
    "from tests.models import TinyLM\n"
    "big = TinyLM(n_blocks=25)\n"
    "for block in big.blocks:\n"
    "    fully_shard(block, mesh=init_device_mesh('cpu', (world_size,)))\n"
    "fully_shard(big, mesh=init_device_mesh('cpu', (world_size,)))\n"
    "big(torch.randint(0, 32, (2, 8))).square().mean().backward()",
    "big_source = RankModel(current_pool(), 'big')\nLayoutView(big_source)",
    "GradNormView(big_source, by='units', top=8)",
    "import tempfile\nfrom fsdp_interactive.notebook import CheckpointPanel\n"
    "CheckpointPanel(source, tempfile.mkdtemp(prefix='fsdpi-ckpt-'))",
    "%%fsdp\nimport fsdp_interactive\nprobe_value = 40 + rank\n"
    "fsdp_interactive.breakpoint(rank=1)\nprint('after the breakpoint:', probe_value)",
    "%fsdp stop\nprint('pool stopped')",
]

#: Steps of the live bars; each step waits for a gate file that the test opens once the
#: page shows the bar at that step (so a bar drawn only at the end never opens one).
BAR_STEPS = 4


def bar_cells(gates: Path) -> list[str]:
    """Cells with a ``tqdm.auto`` bar and a plain ``tqdm`` bar, streamed (the server runs
    with IPP_NONINTERACTIVE=1, which makes ``--no-stream`` the default)."""
    auto = "auto_tqdm(RANGE, desc='live widget bar', mininterval=0)"
    plain = "tqdm(RANGE, desc='live text bar', mininterval=0)"
    return [
        "%%fsdp --stream\n"
        + gated_loop(
            gates / "auto", BAR_STEPS, auto, setup="from tqdm.auto import tqdm as auto_tqdm"
        ),
        "%%fsdp --stream\n"
        + gated_loop(gates / "plain", BAR_STEPS, plain, setup="from tqdm import tqdm"),
    ]


def _serving_at(
    runtime: Path, proc: subprocess.Popen, token: str, log: Path, timeout: float = 90
) -> str:
    """The base URL of the Jupyter server ``proc`` once it answers: its port is the one it
    wrote into its server file in ``runtime`` (the OS chose it, so no other process can
    hold it meanwhile)."""
    info = runtime / f"jpserver-{proc.pid}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}; its log:\n{tail}")
        if info.exists():
            with contextlib.suppress(ValueError, OSError):
                base = f"http://127.0.0.1:{json.loads(info.read_text())['port']}"
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as reply:
                    if reply.status == 200:
                        return base
        time.sleep(0.5)
    raise TimeoutError(
        f"jupyter lab wrote no server file in {runtime} or did not answer within {timeout}s"
    )


# CI sets this after installing Chromium: there a missing piece is a failure, not a skip.
REQUIRED = os.environ.get("FSDPI_REQUIRE_BROWSER") == "1"


def _missing(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"FSDPI_REQUIRE_BROWSER=1 but the browser test {reason}")
    pytest.skip(reason)


@pytest.fixture()
def lab(tmp_path):
    for module, extra in (("jupyterlab", "jupyterlab"), ("playwright.sync_api", "playwright")):
        try:
            __import__(module)
        except ImportError:
            _missing(f"needs {extra} (pip install '.[browser]')")
    if CHROMIUM is None:
        _missing("needs Debian's chromium (apt-get install chromium)")
    gates = tmp_path / "gates"
    for kind in ("auto", "plain"):
        (gates / kind).mkdir(parents=True)
    notebook = nbformat.v4.new_notebook()
    sources = [*CELLS[:-1], *bar_cells(gates), CELLS[-1]]
    notebook.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nbformat.write(notebook, tmp_path / "widgets.ipynb")
    token = secrets.token_hex(16)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        IPYTHONDIR=str(tmp_path / "ipython"),
        IPP_NONINTERACTIVE="1",
        JUPYTER_TOKEN=token,  # not on the command line, where other users could read it
    )
    log = open(tmp_path / "lab.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.port=0",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.root_dir={tmp_path}",
            "--LabApp.expose_app_in_browser=True",
            "--ServerApp.port_retries=0",
            "--allow-root",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = _serving_at(tmp_path / "runtime", proc, token, tmp_path / "lab.log")
        yield f"{base}/lab/tree/widgets.ipynb?token={token}", tmp_path
    finally:
        proc.terminate()  # the server shuts its kernels down; their pools stop at exit
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


#: An input box the running cell waits on. A box answered already stays in the page,
#: hidden by this class, until JupyterLab removes it 0.5 s later; it takes no more answers
#: (what is typed into it goes nowhere), so it must never be taken for the next prompt.
_OPEN_PROMPT = ".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding)"


def _answer_prompt(page, command: str, prompt: str = "(rank 1 Pdb)") -> Any:
    """Type ``command`` into the input box the running cell opened (``input()``) and waits
    on, asking ``prompt``; the box answered (an element handle)."""
    waiting = page.locator(_OPEN_PROMPT).filter(
        has=page.locator(".jp-Stdin-prompt", has_text=prompt)
    )
    _wait_or_say(page, waiting.last, f"an open input box asking {prompt!r}", 240_000)
    # One element for both steps: a locator is resolved again at each step.
    box = waiting.last.locator(".jp-Stdin-input").element_handle()
    box.fill(command)
    box.press("Enter")
    page.wait_for_function(
        "box => !box.isConnected || box.closest('.jp-OutputArea-stdin-hiding') !== null",
        arg=box,
        timeout=30_000,
    )
    return box


def _wait_or_say(page, locator, waited_for: str, timeout_ms: float) -> None:
    """``locator.wait_for``; on timeout an AssertionError that says what was waited for and
    what the page showed instead."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        locator.wait_for(timeout=timeout_ms)
    except PlaywrightTimeout:
        raise AssertionError(
            f"waited {timeout_ms / 1000:g} s for {waited_for}; the page showed instead:\n"
            + _page_summary(page)
        ) from None


def _page_summary(page) -> str:
    """The open input boxes and the last outputs of the page, as text."""
    prompts = page.locator(_OPEN_PROMPT).all_inner_texts()
    outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
    return (
        f"open input boxes: {prompts or 'none'}\nlast outputs (of {len(outputs)}):\n"
        + "\n".join(f"  | {text.strip()[:300]!r}" for text in outputs[-6:])
    )


def _when_removed(page, element, action) -> None:
    """Run ``action()`` once ``element`` has left the page (checked while the test waits
    on the page: Playwright hands console messages over during its waits)."""
    token = f"fsdpi-removed-{secrets.token_hex(4)}"

    def on_console(message) -> None:
        if message.text == token:
            page.remove_listener("console", on_console)
            action()

    page.on("console", on_console)
    page.evaluate(
        """([element, token]) => {
            const done = () => { observer.disconnect(); console.log(token); };
            const observer = new MutationObserver(() => { if (!element.isConnected) done(); });
            observer.observe(document.body, {childList: true, subtree: true});
            if (!element.isConnected) done();
        }""",
        [element, token],
    )


def _follow_bar(page, label: str, gates: Path, widget: bool) -> list[str]:
    """Open each gate of the bar ``label`` once the page shows the bar at that step; the
    widths of the widget's progress bar seen at each step (``widget``)."""
    output = page.locator(".jp-OutputArea-output").filter(has_text=label)
    widths = []
    try:
        for step in range(BAR_STEPS):
            _wait_or_say(
                page,
                output.filter(has_text=f"{step}/{BAR_STEPS}").first,
                f"the bar {label!r} at {step}/{BAR_STEPS}",
                180_000,
            )
            if widget:
                fill = output.first.locator(".progress-bar")
                page.wait_for_function(
                    "([bar, width]) => bar.style.width === width",
                    arg=[fill.element_handle(), f"{100 * step // BAR_STEPS}%"],
                    timeout=30_000,
                )
                widths.append(fill.evaluate("bar => bar.style.width"))
            (gates / f"go{step}").touch()
    finally:
        for step in range(BAR_STEPS):  # whatever happened, let the cell end
            (gates / f"go{step}").touch()
    return widths


def test_widgets_render_in_jupyterlab(lab):
    from playwright import sync_api

    url, tmp_path = lab
    with sync_api.sync_playwright() as driver:
        browser = driver.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2200})
            page.goto(url)
            page.wait_for_function(
                "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                " return w && w.sessionContext && w.sessionContext.session"
                " && w.sessionContext.session.kernel"
                " && w.sessionContext.session.kernel.connectionStatus === 'connected'; }",
                timeout=120_000,
            )
            # Not awaited: the run waits for input at the breakpoint, answered below.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            # The breakpoint on rank 1 asks for pdb commands in the notebook's input box.
            # The first command holds rank 1 until JupyterLab has removed the box it was
            # typed into (an answered box stays in the page, hidden, for 0.5 s): the next
            # command must wait for the next prompt's box, not go into the answered one.
            released = tmp_path / "gates" / "pdb"
            answered = _answer_prompt(page, f"p {held_until(released)} or probe_value * 2")
            _when_removed(page, answered, released.touch)
            _answer_prompt(page, "c")
            answer = page.locator(".jp-OutputArea-output").get_by_text("82", exact=True)
            _wait_or_say(page, answer, "rank 1's answer to 'p probe_value * 2' (82)", 60_000)
            # Each step waits for the page to show the previous one: the bars move live.
            widths = _follow_bar(page, "live widget bar", tmp_path / "gates" / "auto", True)
            assert widths == [f"{100 * step // BAR_STEPS}%" for step in range(BAR_STEPS)]
            _follow_bar(page, "live text bar", tmp_path / "gates" / "plain", False)
            stopped = page.locator(".jp-OutputArea-output").filter(has_text="pool stopped")
            _wait_or_say(page, stopped, "the last cell's 'pool stopped'", 240_000)
            tables = page.locator(".widget-html-content table.fsdp-interactive")
            _wait_or_say(page, tables.first, "the layout views' tables", 60_000)
            text = " ".join(tables.all_inner_texts())
            shots = REPO / "out" / "figures"
            with contextlib.suppress(OSError):
                shots.mkdir(parents=True, exist_ok=True)
            folder = shots if shots.is_dir() else tmp_path
            page.screenshot(path=str(folder / "jupyterlab_widgets.png"), full_page=True)
            # The notebook scrolls inside the page: one picture per widget output, to look at.
            widgets = page.locator(".jp-OutputArea-output").filter(has=page.locator(".widget-box"))
            for index in range(widgets.count()):
                widgets.nth(index).screenshot(path=str(folder / f"jupyterlab_widget_{index}.png"))
            for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
                assert name in text
            # 305 parameters: 25 alike blocks fold into one unit row, the rest is cut to top k
            assert "blocks.{0..24}" in text
            notes = " ".join(page.locator(".widget-html-content").all_inner_texts())
            assert "showing 30 of 305 parameters" in notes
            assert page.locator("input[placeholder^='filter']").count() >= 4
            save = page.locator(".widget-button").filter(has_text="Save now").first
            assert save.evaluate("b => b.scrollWidth <= b.clientWidth + 1"), "Save now is cut"
            assert save.bounding_box()["width"] >= 80
            progress = page.locator(".widget-hprogress").first
            assert progress.bounding_box()["width"] >= 150
            assert page.locator(".widget-image").count() >= 2
            html_texts = page.locator(".widget-html-content").all_inner_texts()
            # one statement of the global norm per gradient-norm view (there are two)
            assert sum(t.count("global L2 gradient norm") for t in html_texts) == 2
            outputs = " ".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            assert "rank 1 stopped; the other ranks wait" in outputs
            assert "after the breakpoint: 40" in outputs
            # Each bar stays as one output in its final state (the widget: full, green).
            finished = page.locator(".jp-OutputArea-output").filter(has_text="live widget bar")
            assert finished.count() == 1
            assert finished.locator(".progress-bar-success").count() == 1
            assert finished.locator(".progress-bar").evaluate("b => b.style.width") == "100%"
            text_bar = page.locator(".jp-OutputArea-output").filter(has_text="live text bar")
            assert text_bar.count() == 1
            assert f"{BAR_STEPS}/{BAR_STEPS}" in text_bar.inner_text()
        finally:
            browser.close()
