"""CUDA/NCCL behaviour of the pool; these run only where a GPU is present (one suffices).

Their CPU halves, with CUDA stood in for, are ``test_cuda_logic.py`` and
``test_cuda_paths.py``; ``make gpu-check`` runs these too, with its own checks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import gpu_check
from fsdp_interactive.pool import Pool, visible_cuda_device_count
from fsdp_interactive.pool.rank import _bootstrap

pytestmark = pytest.mark.cuda


def test_devices_are_counted_without_cuda_in_the_calling_process():
    # A fresh interpreter stands in for the notebook kernel.
    code = (
        "from fsdp_interactive.pool import visible_cuda_device_count\n"
        "from fsdp_interactive.pool.processes._devices import cuda_handles\n"
        "n = visible_cuda_device_count()\n"
        "assert n >= 1, n\n"
        "assert cuda_handles() == [], cuda_handles()\n"
        "print(n)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == visible_cuda_device_count()


def test_a_kernel_that_runs_an_nccl_pool_never_opens_the_gpu():
    """The rank is pinned to the last device, sees it as cuda:0 with LOCAL_RANK 0, its
    tensors come back on the CPU, NCCL's recorder is read; the kernel (a fresh
    interpreter) holds no /dev/nvidia* file afterwards, nor does the engine forker."""
    code = (
        "import os\n"
        "from fsdp_interactive.pool import Pool, visible_cuda_device_count\n"
        "from fsdp_interactive.pool.processes._devices import cuda_handles\n"
        "from bench.gpu_check import rank_facts\n"
        "last = visible_cuda_device_count() - 1\n"
        "with Pool(devices=[last], show_topology=False) as pool:\n"
        "    record = pool.topology[0]\n"
        "    assert (record.device, record.backend) == ('cuda:0', 'nccl'), record\n"
        "    assert record.visible_devices == str(last), record\n"
        "    facts = pool.call(rank_facts)[0]\n"
        "    assert facts['CUDA_VISIBLE_DEVICES'] == str(last) and facts['LOCAL_RANK'] == '0'\n"
        "    assert facts['current_device'] == 0 and facts['device_count'] == 1, facts\n"
        "    pool.run('t = torch.ones(3, device=device); dist.all_reduce(t)', stream=False)\n"
        "    (t,) = pool.pull('t')\n"
        "    assert type(t).__name__ == 'Tensor' and t.device.type == 'cpu', t\n"
        "    dump = pool.trace().dumps[0]\n"
        "    assert dump.note is None, dump.note\n"
        "    assert [r.backend for r in dump.records][-1] == 'nccl', dump.records\n"
        "    forker = pool._processes._forker  # engines were forked from it after CUDA choices\n"
        "    assert forker is not None and cuda_handles(forker.pid) == []\n"
        "assert cuda_handles() == [], cuda_handles()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_engines_report_their_devices_without_initialising_cuda(profile_dir):
    with Pool(1, devices="cpu", profile_dir=profile_dir, show_topology=False) as pool:
        (described,) = pool.call(_bootstrap.describe_engine, True)
        assert described["cuda_devices"] == visible_cuda_device_count()
        assert pool.call(lambda: __import__("torch").cuda.is_initialized()) == [False]


def test_a_rank_waiting_for_its_gpu_behind_nccl_work_is_reported_blocked():
    ctx = gpu_check.Context(gpu=True, device=visible_cuda_device_count() - 1)
    try:
        assert "behind nccl all_reduce" in gpu_check.check_blocked_behind_nccl(ctx)
    finally:
        if ctx.pool is not None:
            ctx.pool.stop()


def test_the_nccl_watchdog_spares_a_rank_at_a_breakpoint_and_ends_one_that_is_not():
    ctx = gpu_check.Context(gpu=True, device=visible_cuda_device_count() - 1)
    assert "held rank survived" in gpu_check.check_watchdog_hold(ctx)


def test_devices_that_are_not_present_are_rejected():
    count = visible_cuda_device_count()
    with pytest.raises(ValueError, match="not present"):
        Pool(devices=[count]).start()
    with pytest.raises(ValueError, match="CUDA device"):
        Pool(n=count + 1).start()
