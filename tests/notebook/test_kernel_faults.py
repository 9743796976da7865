"""A rank killed between cells, through a real Jupyter kernel and its IOPub messages (what
JupyterLab receives), on a pool started with ``%fsdp start --recover auto``. Before any
snapshot, ``%fsdp recover``, ``%fsdp status`` and the next cell's ``RankDied`` name only
what works (``%fsdp restart``), and auto mode claims no failed recovery; with a snapshot,
the next cell recovers by itself and its phases reach the notebook while it recovers,
before the cell's error says what was restored. ``%fsdp status`` leaves torch out of the
kernel (importing it there is what made the first status take seconds)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_interactive.pool.processes._pids import start_time
from tests.notebook.gates import Gates
from tests.notebook.test_kernel_output import Kernel, pool_kernel
from tests.pool.conftest import wait_gone
from tests.pool.recovery_cells import SETUP

FRESH_GROUP = "recovery: a fresh group of 2 ranks is up"


def _gated_setup(gate: Path) -> str:
    """The setup cell; replayed by a recovery, it waits for ``gate`` to be opened."""
    return (
        SETUP
        + "import os, time\nfrom fsdp_interactive import _notices\n"
        + f"while _notices.replaying() and not os.path.exists({str(gate)!r}):\n"
        + "    time.sleep(0.02)\n"
    )


@pytest.fixture()
def kernel() -> Iterator[Kernel]:
    with pool_kernel("-n 2 --backend gloo --recover auto") as started:
        yield started


def _text(messages: list[dict[str, Any]]) -> str:
    return "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")


def _errors(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["msg_type"] == "error"]


def _kill_rank_1(kernel: Kernel) -> None:
    """SIGKILL rank 1 of the kernel's pool while no cell runs; wait until it is gone."""
    shown = kernel.run(
        "from fsdp_interactive.notebook import current_pool\n"
        "print('pid', current_pool().topology[1].pid)"
    )
    pid = int(_text(shown).split("pid", 1)[1].split()[0])
    created = start_time(pid)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone({pid: created}, timeout=30) == []


@pytest.mark.timing
def test_deaths_between_cells_with_recover_auto(kernel, tmp_path):
    """Before any snapshot: recover, status and the next cell name only what works; with
    one: the next cell recovers by itself, its phases shown while it recovers."""
    status = kernel.run(
        "%fsdp status\nimport sys\nprint('torch in the kernel:', 'torch' in sys.modules)"
    )
    assert "pool running, 2 ranks" in _text(status) and "RSS" in _text(status)
    assert "torch in the kernel: False" in _text(status)
    [refused] = _errors(kernel.run("%fsdp recover"))
    shown = "\n".join(refused["content"]["traceback"])
    assert refused["content"]["ename"] == "RecoveryError" and "nothing was changed" in shown
    assert "%fsdp snapshot MODEL OPTIMIZER" in shown and "%fsdp recover --from DIR" in shown
    assert "pool.recover" not in shown and "from_=" not in shown

    setup = "%%fsdp\n" + _gated_setup(tmp_path / "go0")
    assert not _errors(kernel.run(setup))
    _kill_rank_1(kernel)
    status = kernel.run("%fsdp status")
    assert not _errors(status)
    assert "pool broken: rank 1 (pid" in _text(status) and "%fsdp restart" in _text(status)
    assert "%fsdp recover" not in _text(status)
    [died] = _errors(kernel.run("%%fsdp\nprint('the cell ran')"))
    shown = "\n".join(died["content"]["traceback"])
    assert died["content"]["ename"] == "RankDied" and "This call did not run." in shown
    assert "%fsdp restart" in shown and "%fsdp recover" not in shown
    assert "Automatic recovery failed" not in shown and "nothing to recover to" in shown

    gates = Gates(tmp_path, 1, fallback_s=120.0)
    try:
        kernel.run("%fsdp restart")
        taken = kernel.run(setup) + kernel.run(
            "%%fsdp --no-replay\nimport fsdp_interactive\n"
            "fsdp_interactive.snapshot(model=model, optimizer=optim, step=5)"
        )
        assert not _errors(taken), taken
        _kill_rank_1(kernel)

        def watch(message: dict[str, Any]) -> None:
            # The replay waits until the notebook has shown that the group is up.
            if message["msg_type"] == "stream" and FRESH_GROUP in message["content"]["text"]:
                gates.observe("0/1")

        messages = kernel.run("%%fsdp\nprint('the cell ran')", on_message=watch, timeout=240)
    finally:
        gates.close()
    assert gates.opened_by_sight == [0], "the recovery was shown only once it had ended"
    [error] = _errors(messages)
    replayed = [m for m in messages if "recovery: replayed In[" in m["content"].get("text", "")]
    assert replayed and messages.index(error) > messages.index(replayed[-1])
    assert error["content"]["ename"] == "RankDied"
    shown = "\n".join(error["content"]["traceback"])
    assert "rank 1 (pid" in shown and "killed by signal SIGKILL" in shown
    assert "This call did not run." in shown and "of step 5" in shown
    assert "recovered to the snapshot" in shown and "Run the cell again to continue." in shown
    assert "the cell ran" not in _text(messages)
    again = kernel.run("%%fsdp\nprint('ran', int(next(model.parameters()).numel() > 0))")
    assert not _errors(again) and "ran 1" in _text(again)
