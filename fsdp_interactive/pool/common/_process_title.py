"""A process's title as ``ps`` and ``top`` show it: engines, their nannies and ranks name
themselves so that a user can tell which process is which (and whose pool it is).

Imported by the rank side (each rank's title) and by the processes the pool forks (each
engine's nanny); standard library only.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def set_title(title: str) -> None:
    """Show ``title`` as this process's command line (``ps``, ``psutil.Process.cmdline()``)
    and, cut to 15 characters, as its name (``top``, ``psutil.Process.name()``).

    Linux: the title is written over the original command line's memory, whose bounds
    the kernel gives in ``/proc/self/stat`` (it is cut to that length, and the
    environment block next to it is left alone, so ``/proc/<pid>/environ`` stays
    readable); the name through ``prctl(PR_SET_NAME)``. setproctitle would find that
    memory by scanning from the environment, which a forked engine has rebuilt.
    Elsewhere, or when the kernel does not say, nothing changes.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/self/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2 :].split()
        arg_start, arg_end = int(fields[45]), int(fields[46])  # fields 48 and 49 of stat(5)
    except (OSError, ValueError, IndexError, AttributeError):
        log.debug("no process title on this platform")
        return
    size = arg_end - arg_start
    if size > 1:
        data = title.encode()[: size - 1]
        ctypes.memmove(arg_start, data + b"\0" * (size - len(data)), size)
    pr_set_name = 15
    libc.prctl(pr_set_name, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)
