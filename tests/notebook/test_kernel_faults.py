"""A rank killed between cells, through a real Jupyter kernel and its IOPub messages (what
JupyterLab receives), on a pool started with ``%fsdp start --recover auto``. Before any
snapshot, ``%fsdp recover``, ``%fsdp status`` and the next cell's ``RankDied`` name only
what works (``%fsdp restart``), and auto mode claims no failed recovery; with a snapshot,
the next cell recovers by itself and its phases reach the notebook while it recovers,
before the cell's error says what was restored. ``%fsdp status`` leaves torch out of the
kernel (importing it there is what made the first status take seconds). A dashboard on a second
model takes its snapshot and recovers to it: the first model comes back as it was built,
and the dashboard shows the new group, after its own Recover and after ``%fsdp recover``.
A cell cut by a death ends its bar red, saying it was cut and the step recovered to."""

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


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    """One kernel for the module (its tests run in this order: the first needs a pool that
    took no snapshot yet)."""
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
    assert "recovered to the snapshot" in shown
    assert "Run the cell again to go on from step 5, the snapshot's" in shown
    assert "the cell ran" not in _text(messages)
    again = kernel.run("%%fsdp\nprint('ran', int(next(model.parameters()).numel() > 0))")
    assert not _errors(again) and "ran 1" in _text(again)


WITH_A_PROBE = (
    SETUP
    + """
import fsdp_interactive
probe = FSDP(torch.nn.Linear(32, 32))
popt = torch.optim.SGD(probe.parameters(), lr=0.1)
def total(module):
    return sum(p.to_local().double().sum().item() for p in module.parameters())
"""
)
#: Prints every rank's sum of a module's local shards (as printed: bit for bit).
SUMS = "%%fsdp --group-outputs rank\nprint(repr(total({})))"


def _sums(kernel: Kernel, module: str) -> list[str]:
    messages = kernel.run(SUMS.format(module))
    assert not _errors(messages), messages
    return sorted(line for line in _text(messages).splitlines() if line.startswith("[rank"))


def _shown(kernel: Kernel, expression: str) -> str:
    messages = kernel.run(f"print({expression})")
    assert not _errors(messages), messages
    return _text(messages)


def test_a_dashboard_on_a_second_model_snapshots_and_recovers_it(kernel):
    """As in notebook 09 with a second model: the dashboard's Snapshot now keeps only the
    probe; its Recover brings the probe back as snapshotted and the model as its cell
    built it (never uninitialized memory), and the dashboard shows the new group."""
    kernel.run("%fsdp restart")
    assert not _errors(kernel.run("%%fsdp\n" + WITH_A_PROBE))
    built = _sums(kernel, "model")
    step = "x, y = synthetic_batch(0, rank)\n" + (
        "torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()\n"
        "optim.step()\nprobe(torch.ones(2, 32)).sum().backward()\npopt.step()"
    )
    assert not _errors(kernel.run("%%fsdp --no-replay\n" + step))
    setup = kernel.run(
        "from fsdp_interactive.notebook import Dashboard, RankModel, current_pool\n"
        "pool = current_pool()\n"
        "board = Dashboard(RankModel(pool, 'probe', 'popt'))\n"
        "board.widget\n"
        "board._tabs.selected_index = 4  # the Snapshots tab draws its part\n"
        "board.snapshots._snapshot_button.click()\n"
        "print(board.snapshots.status)"
    )
    assert not _errors(setup), [e["content"]["traceback"] for e in _errors(setup)]
    assert "took snapshot s" in _text(setup)
    assert "of probe, popt" in _text(setup)
    taken = _sums(kernel, "probe")
    old_pids = _shown(kernel, "[r.pid for r in pool.topology]")
    clicked = kernel.run("board.snapshots._recover_button.click()\nprint(board.snapshots.status)")
    assert not _errors(clicked) and "recovered to the snapshot" in _text(clicked)
    assert _sums(kernel, "model") == built  # as In[..] built it: not the trained state, not nan
    assert _sums(kernel, "probe") == taken
    report = _shown(kernel, "board.snapshots.report")
    assert "restored from s" in report and "probe (the model), popt (the optimizer)" in report
    assert "rebuilt by the replay: " in report and "model" in report
    # The dashboard refreshed itself: the new group's ranks, none of the old pids.
    pids = _shown(kernel, "[r.pid for r in pool.topology]")
    ranks_tab = _shown(kernel, "board._ranks.value")
    assert "pool running, 2 ranks" in ranks_tab and pids != old_pids
    assert all(pid not in ranks_tab for pid in old_pids.strip("[]\n").split(", "))
    # After a recovery by magic, the same without a click on Refresh all.
    _kill_rank_1(kernel)
    kernel.run("%fsdp recover")
    ranks_tab = _shown(kernel, "board._ranks.value")
    assert "pool running, 2 ranks" in ranks_tab and "pool broken" not in ranks_tab


def test_a_cell_cut_by_a_death_ends_its_bar_as_cut_at_the_recovered_step(kernel, tmp_path):
    kernel.run("%fsdp restart")
    assert not _errors(kernel.run("%%fsdp\n" + WITH_A_PROBE))
    kernel.run("%%fsdp --no-replay\nfsdp_interactive.snapshot(model=probe, optimizer=popt, step=7)")
    gate = tmp_path / "go"
    cut = (
        "%%fsdp\nimport os, signal, time\nfrom tqdm.auto import tqdm\n"
        "for i in tqdm(range(10), desc='train', mininterval=0):\n"
        "    if i == 3 and rank == 1:  # once the notebook shows rank 0's bar at 3 of 10\n"
        f"        while not os.path.exists({str(gate)!r}):\n"
        "            time.sleep(0.02)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    dist.barrier()\n"
    )

    def watch(message: dict[str, Any]) -> None:
        # The kernel's widget bar took rank 0's state at 3 of 10.
        state = message["content"].get("data", {}).get("state", {})
        if message["msg_type"] == "comm_msg" and state.get("value") == 3.0:
            gate.touch()

    try:
        messages = kernel.run(cut, on_message=watch, timeout=240)
    finally:
        gate.touch()
    [error] = _errors(messages)
    shown = "\n".join(error["content"]["traceback"])
    assert "recovered to the snapshot" in shown and "of step 7" in shown
    assert "Run the cell again to go on from step 7" in shown
    bars = [
        m["content"]["data"]["text/plain"]
        for m in messages
        if m["msg_type"] in ("display_data", "update_display_data")
        and "train:" in m["content"]["data"].get("text/plain", "")
    ]
    assert bars[-1].startswith("train:  30%") and bars[-1].endswith(
        "[cut: rank 1 died; recovered to step 7]"
    ), bars
    styles = [
        m["content"]["data"]["state"]["bar_style"]
        for m in messages
        if m["msg_type"] == "comm_msg" and "bar_style" in m["content"]["data"].get("state", {})
    ]
    assert styles[-1] == "danger"
