"""The tutorial notebooks run top to bottom and reproduce their stored outputs (nbval).

One nbval run in a subprocess covers every notebook in ``notebooks/``: each code cell is
executed in a fresh kernel and its output compared with the output stored in the notebook,
after the replacements in ``sanitize.cfg`` (pids, hosts, ports, paths, times).  The run's
JUnit report must show every code cell of every notebook as passed, so a notebook that is
not collected (or a cell that is skipped) fails this test.

The stored outputs are made on the CPU kernels torch and MKL pick for this machine (the
refresh below), and the run takes the lowest kernel paths both offer
(``ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE``). Float results differ between kernel
paths in their last digits (another machine's CPU takes another path), so the stored
outputs show computed numbers only to digits that every path agrees on; comparing a run on
the lowest path with outputs made on the native one proves it on any machine, since the
lowest path differs from the native one everywhere, and proves at the same time that
every notebook reproduces its outputs. Every notebook prints computed floats, so the run
covers all of them. A second run on the native kernels would add only the notebooks'
code on those kernels, which the rest of the suite runs on them.

Every process of a run carries a marker in its environment; after the run no process
with that marker may be alive (the notebooks stop their pools; nothing may leak).

To refresh the stored outputs after a deliberate change, re-execute the notebook on the
native kernels (neither variable above set): ``IPP_NONINTERACTIVE=1 .venv/bin/jupyter execute --inplace notebooks/NN_name.ipynb``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool.processes._pids import end_processes, start_time

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
SANITIZE = Path(__file__).with_name("sanitize.cfg")
MARKER = "FSDP_INTERACTIVE_TUTORIAL_RUN"
CELL_TIMEOUT_S = 300
RUN_TIMEOUT_S = 900


def code_cell_count(notebook: Path) -> int:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return sum(1 for cell in cells if cell["cell_type"] == "code")


def processes_with_marker(value: str) -> list[psutil.Process]:
    """Live processes whose environment holds ``MARKER=value`` (only ours can match)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == value:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def passed_cells(report: Path) -> dict[str, int]:
    """Passed test items per notebook file name, from the JUnit report."""
    counts: dict[str, int] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if any(child.tag in ("failure", "error", "skipped") for child in case):
            continue
        name = Path(case.get("file", "")).name  # xunit1 reports name the notebook file
        counts[name] = counts.get(name, 0) + 1
    return counts


#: The lowest kernel paths torch and MKL offer (the stored outputs come from the native ones).
LOWEST_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_every_notebook_runs_and_reproduces_its_outputs_on_the_lowest_kernel_paths(tmp_path):
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert notebooks, f"no notebooks in {NOTEBOOKS}"
    report = tmp_path / "nbval.xml"
    marker = uuid.uuid4().hex
    # IPP_NONINTERACTIVE: %%fsdp shows rank outputs when a cell ends, grouped in rank order,
    # instead of streaming them in arrival order (as ipyparallel's %%px does for nbval).
    # FSDPI_OVERSUBSCRIBE: notebooks that start 4 ranks on a 2-core machine store no warning.
    env = {
        **os.environ,
        **LOWEST_KERNELS,
        MARKER: marker,
        "IPP_NONINTERACTIVE": "1",
        "FSDPI_OVERSUBSCRIBE": "1",
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--nbval",
        "--nbval-current-env",
        f"--nbval-sanitize-with={SANITIZE}",
        f"--nbval-cell-timeout={CELL_TIMEOUT_S}",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={report}",
        "-q",
        *(str(n.relative_to(ROOT)) for n in notebooks),
    ]
    try:
        run = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    finally:
        time.sleep(1)  # let exiting engines finish their shutdown
        leaked = processes_with_marker(marker)
        leaked_desc = [f"{p.pid} {' '.join(p.cmdline()[:3])}" for p in leaked if p.is_running()]
        # by pid and start time, as found (psutil.Process keeps the start time it saw)
        end_processes({p.pid: start_time(p.pid) for p in leaked})
    output = run.stdout[-20000:] + run.stderr[-5000:]
    assert run.returncode == 0, f"nbval failed:\n{output}"
    assert not leaked_desc, f"processes left running after the notebooks: {leaked_desc}"

    passed = passed_cells(report)
    expected = {n.name: code_cell_count(n) for n in notebooks}
    missing = {name: (passed.get(name, 0), count) for name, count in expected.items()}
    missing = {name: seen for name, seen in missing.items() if seen[0] != seen[1]}
    assert not missing, (
        "notebooks whose code cells did not all run and pass (passed, code cells): "
        f"{missing}\n{output}"
    )
