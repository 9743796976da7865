"""Local engines are forked from one process that imported torch once; the kernel stays light."""

from __future__ import annotations

import json

import psutil

from fsdp_interactive.pool import Pool
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
        assert "fsdp_interactive.pool._engine_forker" in " ".join(psutil.Process(forker).cmdline())
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
