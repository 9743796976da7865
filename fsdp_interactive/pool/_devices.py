"""Counting CUDA devices without creating a CUDA context in the calling process.

``torch.cuda.device_count()`` initialises the CUDA driver in the caller (and with some
builds creates a context), which the notebook kernel must never do. Instead:

* a CPU-only torch build (``torch.version.cuda`` and ``torch.version.hip`` are None)
  has no devices, decided without any probe;
* ``CUDA_VISIBLE_DEVICES`` set to an empty string (or ``-1``) hides every device;
* otherwise a short-lived subprocess with the same interpreter and environment asks
  torch, so the count honours ``CUDA_VISIBLE_DEVICES`` exactly as the engines will.

The result is cached per process and environment value. Not done: GPU names or memory
(ask the ranks for those).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys

# ``cuda: Optional[str] = '12.4'`` / ``hip = '6.1'`` (anything but None) in torch/version.py
_ASSIGNED = re.compile(r"^(cuda|hip)\b[^=]*=\s*(?!None\b)\S")
_PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def cuda_build() -> bool:
    """True when the installed torch was built with CUDA or ROCm (no device is touched).

    Reads ``torch/version.py`` as text when torch is not imported yet (importing torch
    takes seconds); falls back to importing it.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return False
        path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            import torch
        else:
            return any(_ASSIGNED.search(line) for line in text.splitlines())
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def visible_cuda_device_count(timeout: float = 120.0) -> int:
    """Number of CUDA devices the engines will see; never initialises CUDA here."""
    return _count(os.environ.get("CUDA_VISIBLE_DEVICES"), timeout)


@functools.lru_cache(maxsize=8)
def _count(visible: str | None, timeout: float) -> int:
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    if not cuda_build():
        return 0
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        return 0
    try:
        return int(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0
