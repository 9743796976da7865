"""``memory()``: this rank's memory figures (rank side)."""

from __future__ import annotations

import os
import socket

import psutil
import torch

from fsdp_interactive.inspect._records import MemoryStats
from fsdp_interactive.wrapping._param import world


def memory() -> MemoryStats:
    """Process RSS of this rank, plus CUDA allocator figures when this rank uses CUDA.

    The CUDA figures are read only if CUDA is already initialized in this process (a CPU
    rank never creates a CUDA context because of this probe).  Not a collective.
    """
    rank, _ = world()
    rss = psutil.Process(os.getpid()).memory_info().rss
    device = "cpu"
    allocated = reserved = peak = total = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        device = f"cuda:{index}"
        allocated = int(torch.cuda.memory_allocated(index))
        reserved = int(torch.cuda.memory_reserved(index))
        peak = int(torch.cuda.max_memory_allocated(index))
        total = int(torch.cuda.get_device_properties(index).total_memory)
    return MemoryStats(
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        rss_bytes=int(rss),
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        max_allocated_bytes=peak,
        device_total_bytes=total,
    )
