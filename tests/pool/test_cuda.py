"""CUDA/NCCL behaviour of the pool; these run only where a GPU is present."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdp_interactive.pool import Pool, visible_cuda_device_count

pytestmark = pytest.mark.cuda


def test_devices_are_counted_without_cuda_in_the_calling_process():
    # A fresh interpreter stands in for the notebook kernel.
    code = (
        "import torch\n"
        "from fsdp_interactive.pool import visible_cuda_device_count\n"
        "n = visible_cuda_device_count()\n"
        "assert n >= 1, n\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(n)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == visible_cuda_device_count()


def test_nccl_rank_pinned_to_the_last_device_without_cuda_in_this_process(profile_dir):
    import torch

    last = visible_cuda_device_count() - 1
    with Pool(devices=[last], profile_dir=profile_dir) as pool:
        record = pool.topology[0]
        assert record.device == f"cuda:{last}" and record.backend == "nccl"
        assert pool.call(lambda: __import__("torch").cuda.current_device()) == [last]
        assert pool.run(
            "dist.all_reduce(t := torch.ones(1, device=device)); t.item()", stream=False
        ).results == {0: "1.0"}
    assert not torch.cuda.is_initialized()


def test_devices_that_are_not_present_are_rejected():
    count = visible_cuda_device_count()
    with pytest.raises(ValueError, match="not present"):
        Pool(devices=[count]).start()
    with pytest.raises(ValueError, match="CUDA device"):
        Pool(n=count + 1).start()
