"""The kernel's view of CUDA devices, without ever creating a CUDA context in it.

``torch.cuda.device_count()`` initialises the CUDA driver in the caller (and with some
builds creates a context), which the notebook kernel must never do. Instead
(:mod:`pool.common._cuda_count`):

* a CPU-only torch build (``torch.version.cuda`` and ``torch.version.hip`` are None)
  has no devices, decided without any probe;
* ``CUDA_VISIBLE_DEVICES`` set to an empty string (or ``-1``) hides every device;
* otherwise a short-lived subprocess with the same interpreter and environment asks
  torch, so the count honours ``CUDA_VISIBLE_DEVICES`` exactly as the engines will.

The result is cached per process and environment value. :func:`cuda_handles` tells
whether a process has touched the GPU driver at all (what a kernel must not have).
Not done: GPU names or memory (ask the ranks for those).
"""

from __future__ import annotations

import functools
import os

from fsdp_interactive.pool.common._cuda_count import cuda_build, hidden, probe_count

__all__ = ["cuda_build", "cuda_handles", "visible_cuda_device_count"]


def visible_cuda_device_count(timeout: float = 120.0) -> int:
    """Number of CUDA devices the engines will see; never initialises CUDA here."""
    return _count(os.environ.get("CUDA_VISIBLE_DEVICES"), timeout)


@functools.lru_cache(maxsize=8)
def _count(visible: str | None, timeout: float) -> int:
    if hidden(visible) or not cuda_build():
        return 0
    return probe_count(timeout)


def cuda_handles(pid: int | None = None, *, proc: str = "/proc") -> list[str]:
    """The NVIDIA device files (``/dev/nvidia*``: the driver's control file, one per GPU,
    the unified-memory file) process ``pid`` (default: this one) holds open, sorted.

    A process that initialised the CUDA driver (``cuInit``, which any CUDA call, a
    context, or ``torch.cuda.is_available()`` does) or NVML holds ``/dev/nvidiactl``
    open; one that never touched the GPU holds none. ``torch.cuda.is_initialized()``
    sees only torch's own lazy initialisation, not the driver's. Linux only (reads
    ``{proc}/{pid}/fd``); an empty list where that cannot be read.
    """
    folder = os.path.join(proc, str(os.getpid() if pid is None else pid), "fd")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = set()
    for name in names:
        try:
            target = os.readlink(os.path.join(folder, name))
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.add(target)
    return sorted(found)
