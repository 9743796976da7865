"""Debugging a pool from a real terminal IPython (a subprocess whose stdin is typed input).

One IPython session, as a user would type it: a one-sided barrier under ``--timeout``,
the stack of the sleeping rank, ``%fsdp trace``, ``%fsdp interrupt`` on the blocked
collective, ``%fsdp restart``, a failing cell and ``%fsdp debug``, and a breakpoint on rank 1
stepped through from the same stdin (the debugger's prompts are answered by ``input()``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.notebook.debugger_transcript import debugger_answers

REPO = Path(__file__).resolve().parents[2]


def _cell(line: str, body: str) -> str:
    return f"get_ipython().run_cell_magic('fsdp', {line!r}, {body!r})"


SESSION = [
    "%load_ext fsdp_interactive",
    "%fsdp start -n 2 --backend gloo",
    _cell(
        "--timeout 6 -o hang",
        "import time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(120)\n",
    ),
    "print('SLEEP IN STACK:', 'time.sleep(120)' in hang.stacks[1])",
    "print('DIAGNOSIS:', hang.diagnosis)",
    "%fsdp trace",
    "%fsdp interrupt",
    "%fsdp restart",
    _cell("", "answer = 41 + rank\nif rank == 1:\n    raise ValueError('rank 1 fails')\n"),
    "%fsdp debug -r 1 p answer",
    _cell(
        "--group-outputs rank",
        "import fsdp_interactive\nstep = rank * 10\nfsdp_interactive.breakpoint(rank=1)\n"
        "step += 1\nprint('after the breakpoint:', step)\n",
    ),
    # the debugger's prompts read these lines
    "p step",
    "n",
    "p step",
    "c",
    "%fsdp stop",
]


@pytest.mark.timeout(400)
def test_a_terminal_ipython_session_debugs_a_hang_a_failure_and_a_breakpoint(tmp_path):
    env = dict(
        os.environ,
        IPYTHONDIR=str(tmp_path / "ipython"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--simple-prompt", "--no-banner", "--colors=NoColor"],
        input="\n".join(SESSION) + "\nexit\n",
        capture_output=True,
        text=True,
        timeout=360,
        env=env,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # The timeout names the collective each rank last issued and where they disagree.
    assert "RankTimeout: ranks [0, 1] did not finish within 6s" in out
    assert "collectives: rank 0 waits in barrier #" in out
    assert "rank 1 never issued #" in out
    assert "Cell In[3], line 3" in out  # the notebook's own cell number
    assert "%fsdp interrupt" in out and "pool.interrupt()" not in out
    assert "SLEEP IN STACK: True" in out
    assert "DIAGNOSIS: ['rank 0 waits in barrier #" in out
    # %fsdp trace: the table
    assert "(not issued)" in out
    # %fsdp interrupt says what it did per rank
    assert "rank 0: did not stop: blocked in a collective, in barrier" in out
    assert "rank 1: stopped" in out
    # No snapshot was taken: the advice names only what can work.
    assert "only a new group frees it: %fsdp restart (rank state is discarded)" in out
    assert "%fsdp recover" not in out
    assert "restarted: rank state discarded (2 fresh ranks" in out
    # post-mortem: the failing frame's local, and the hint that led there
    assert "Look at the failing frame with %fsdp debug -r 1." in out
    assert "\n42\n" in out
    # the breakpoint: rank 1 stopped, stepped, continued; the cell finished on both ranks
    assert "rank 1 stopped; the other ranks wait" in out
    assert debugger_answers(out.split("rank 1 stopped; the other ranks wait", 1)[1], 1)[:2] == [
        "10",
        "11",
    ]
    assert "[rank 0] after the breakpoint: 1" in out
    assert "[rank 1] after the breakpoint: 11" in out
    assert "stopped 2 ranks" in out
