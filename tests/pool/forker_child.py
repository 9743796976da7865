"""What the engine forker runs in its tests: report what this process sees, then exit.

``python -m tests.pool.forker_child CODE`` prints one JSON line (pid, session, working
directory, two environment variables, argv, whether torch and the modules named in
``$FORKER_TEST_MODULES`` are already imported, what stdin
holds, a numpy random draw, signal dispositions, the nanny pipes it was given) and exits
with status ``CODE``; ``sleep`` instead of a code waits to be killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def main() -> int:
    import numpy

    nanny_fds = os.environ.get("FSDPI_NANNY_FDS")
    fds = [int(fd) for fd in nanny_fds.split(",")] if nanny_fds else []
    report = {
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "cwd": os.getcwd(),
        "marker": os.environ.get("FORKER_TEST_MARKER"),
        "inherited": os.environ.get("FORKER_TEST_ONLY_IN_FORKER"),
        "snapshot_root": os.environ.get("FSDPI_SNAPSHOT_ROOT"),
        "argv": sys.argv[1:],
        "torch_preloaded": "torch" in sys.modules,
        "loaded": {
            name: name in sys.modules
            for name in os.environ.get("FORKER_TEST_MODULES", "").split(",")
            if name
        },
        "stdin": sys.stdin.read(),
        "draw": float(numpy.random.rand()),
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigpipe_ignored": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
        "nanny_fds": fds,
        "nanny_fds_open": [_open(fd) for fd in fds],
    }
    print(json.dumps(report), flush=True)
    if sys.argv[1:] == ["sleep"]:
        time.sleep(120)
    return int(sys.argv[1]) if len(sys.argv) > 1 else 0


if __name__ == "__main__":
    raise SystemExit(main())
