"""Counting CUDA devices without a CUDA context in the calling process (both sides).

``torch.cuda.device_count()`` may initialise the CUDA driver in the caller (``cuInit``,
when NVML cannot answer), after which ``CUDA_VISIBLE_DEVICES`` no longer changes what the
process sees, and which the notebook kernel must never do. Here:

* :func:`cuda_build`: whether the installed torch was built with CUDA or ROCm, read from
  ``torch/version.py`` as text when torch is not imported yet (no device touched);
* :func:`probe_count`: a short-lived subprocess with the same interpreter and
  environment asks torch, so the count honours ``CUDA_VISIBLE_DEVICES`` exactly as the
  caller's CUDA would, and only the subprocess ever initialises CUDA.

Free of torch in this process (it runs torch in the subprocess only).
"""

from __future__ import annotations

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
    takes seconds); ``True`` when that file cannot be read (a probe then decides).
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
            return True  # cannot tell from here: the probe (a subprocess) decides
        return any(_ASSIGNED.search(line) for line in text.splitlines())
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def hidden(visible: str | None) -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` = ``visible`` hides every device (``""``, ``-1``)."""
    return visible is not None and visible.strip() in ("", "-1")


def probe_count(timeout: float = 120.0) -> int:
    """CUDA devices torch sees in a subprocess of this interpreter and environment (0
    when the probe fails or torch has no CUDA)."""
    if hidden(os.environ.get("CUDA_VISIBLE_DEVICES")) or not cuda_build():
        return 0
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if result.returncode != 0:
        return 0
    try:
        return int(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0
