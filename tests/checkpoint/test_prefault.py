"""``prefault``: the memory of a fresh tensor is backed by the kernel before a read fills
it (Linux 5.14's ``MADV_POPULATE_WRITE``), and nothing happens where it does not apply."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from fsdp_interactive.checkpoint._prefault import MIN_BYTES, prefault


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _kernel_at_least(major: int, minor: int) -> bool:
    release = platform.release().split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


@pytest.mark.skipif(
    platform.system() != "Linux" or not _kernel_at_least(5, 14),
    reason="MADV_POPULATE_WRITE exists from Linux 5.14",
)
def test_a_fresh_tensor_is_resident_after_prefault_before_anything_writes_it():
    size = 256 << 20
    tensor = torch.empty(size, dtype=torch.uint8)  # fresh pages: not resident yet
    before = _resident_bytes()
    assert prefault(tensor) is True
    grown = _resident_bytes() - before
    assert grown >= 0.9 * size, f"resident memory grew by {grown} bytes, expected ~{size}"


def test_small_and_non_cpu_tensors_are_left_alone():
    assert prefault(torch.empty(MIN_BYTES // 8, dtype=torch.uint8)) is False
    assert prefault(torch.empty(MIN_BYTES, dtype=torch.uint8, device="meta")) is False
