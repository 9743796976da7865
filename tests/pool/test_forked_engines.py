"""Local engines are forked from one process that imported torch once; the kernel stays light."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import psutil

from fsdp_interactive.pool import Pool
from fsdp_interactive.pool.processes._pids import process_start
from tests.pool.conftest import record, run_script, wait_gone


def _engine_parents(pool: Pool) -> set[int]:
    return {psutil.Process(r.pid).ppid() for r in pool.topology}


def test_engines_are_forked_and_a_restart_forks_from_the_same_process(profile_dir):
    pool = Pool(n=2, devices="cpu", profile_dir=profile_dir, show_topology=False)
    try:
        pool.start()
        record(pool)
        (forker,) = _engine_parents(pool)
        assert forker in pool.launched_pids  # recorded, so stop() and the reaper end it
        assert "fsdp_interactive.pool.processes._engine_forker" in " ".join(
            psutil.Process(forker).cmdline()
        )
        before = {r.pid for r in pool.topology}
        pool.restart()
        record(pool)
        assert _engine_parents(pool) == {forker}
        assert not before & {r.pid for r in pool.topology}  # fresh engines
        assert pool.call(lambda: __import__("torch").distributed.get_world_size()) == [2, 2]
    finally:
        pool.stop()
        record(pool)
    assert wait_gone(pool.launched_pids) == []


KERNEL_SCRIPT = """
import json, sys
from fsdp_interactive.pool import Pool
pool = Pool(n=2, devices="cpu", profile_dir=sys.argv[1], show_topology=False).start()
pool.run("x = torch.ones(2) * rank", stream=False)
sizes = pool.call(lambda: __import__("torch").distributed.get_world_size())
pool.restart()
pool.stop()
print(json.dumps({"torch_in_kernel": "torch" in sys.modules, "sizes": sizes}))
"""


def test_the_calling_process_never_imports_torch(profile_dir):
    """Start, run, call and restart leave torch out of the notebook side's process."""
    output = run_script(KERNEL_SCRIPT, profile_dir)
    report = json.loads(output.strip().splitlines()[-1])
    assert report == {"torch_in_kernel": False, "sizes": [2, 2]}


def _nannies(forker: int) -> dict[int, psutil.Process]:
    """The forker's nanny children, by the pid of the engine each serves (their title)."""
    found = {}
    for child in psutil.Process(forker).children():
        match = re.search(r"nanny of engine pid (\d+)", " ".join(child.cmdline()))
        if match:
            found[int(match.group(1))] = child
    return found


def test_each_engine_hands_over_to_a_nanny_forked_beside_it(profile_dir):
    """Nannies come ready-made from the forker: one per engine, recorded, relaying
    signals through the controller and reporting an engine's death to it at once (the
    controller's heartbeat would take 30 s)."""
    pool = Pool(n=2, devices="cpu", profile_dir=profile_dir, show_topology=False)
    try:
        pool.start()
        record(pool)
        (forker,) = _engine_parents(pool)
        nannies = _nannies(forker)
        engines = {r.pid: r.engine_id for r in pool.topology}
        assert set(nannies) == set(engines)
        assert {n.pid for n in nannies.values()} <= set(pool.launched_pids)
        client = pool._client
        # SIGWINCH is ignored by the engine: only the nanny's reply is checked.
        reply = client.send_signal(signal.SIGWINCH, targets=list(engines.values()), block=False)
        reply.result(10)
        victim = pool.topology[1]
        nanny = nannies[victim.pid]
        nanny_started = process_start(nanny)
        os.kill(victim.pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while victim.engine_id in client.ids and time.monotonic() < end:
            time.sleep(0.05)
        assert victim.engine_id not in client.ids
        assert wait_gone({nanny.pid: nanny_started}) == []
    finally:
        pool.stop()
        record(pool)
    assert wait_gone(pool.launched_pids) == []
