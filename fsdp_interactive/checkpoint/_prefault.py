"""Backing a tensor's memory at once before a read fills it.

A load reads most of a checkpoint into freshly allocated tensors (the optimizer state
after a recovery: every byte new memory). Left to itself the kernel backs that memory
one 4 KiB page at a time, as the copy from the file first touches each page: one page
fault per page (0.55 GB from tmpfs on a 2-core VM: 0.38 s into fresh memory, 0.30 s when
backed first, of which the read itself 0.14 s). Linux 5.14's
``madvise(MADV_POPULATE_WRITE)`` backs a whole range in one call instead, without
writing it. Elsewhere (older kernels, other systems, memory that refuses it)
:func:`prefault` does nothing, and the read faults its pages in as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

#: ``MADV_POPULATE_WRITE`` (``<linux/mman.h>``, Linux 5.14).
_MADV_POPULATE_WRITE = 23
#: Smaller reads gain nothing measurable from it.
MIN_BYTES = 1 << 20

_madvise = None
if sys.platform == "linux":
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None
_supported = _madvise is not None


def prefault(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back the memory of the contiguous CPU ``tensor`` now (for a write
    that covers all of it); whether it did. Never raises. The first ``EINVAL`` (a kernel
    before 5.14, or memory the call does not apply to) turns it off for the rest of the
    process: the reads then fault their pages in as they always did."""
    global _supported
    size = tensor.numel() * tensor.element_size()
    if not _supported or size < MIN_BYTES or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr() & ~(mmap.PAGESIZE - 1)
    if _madvise(start, tensor.data_ptr() + size - start, _MADV_POPULATE_WRITE) == 0:
        return True
    error = ctypes.get_errno()
    if error == 22:  # EINVAL: a kernel before 5.14 (or a mapping it does not apply to)
        _supported = False
        logger.debug("madvise(MADV_POPULATE_WRITE) refused (EINVAL): reads fault pages in")
    return False
