"""Pool starts and stops in a loop, counting the starts that fail: the stress runner's
check that every engine of a start registers (``make test-stress``, :mod:`tests.stress`).

``python -m tests.start_loop [--sizes 4,8] [--starts N] [--timeout S] [--json FILE]``.
For each size, ``N`` starts of that many CPU ranks, each stopped again, in two kinds:

* ``cold``: ``Pool(n).start()`` with a new engine forker, as a first start;
* ``warm``: a replayable cell imports a few installed modules, the forker warms them
  (:mod:`fsdp_interactive.pool.processes._warm_imports`), and ``restart()`` forks the new
  group from that forker, as a recovery or a restart after some work does.

Each start that raises is a failure, its message kept (the first lines); an engine the
start announced it retried is counted too (a start that retried and then started is no
failure: the retry is the pool's answer to a machine that lost an engine). The load
average is not this module's business: the runner records it around the whole loop and
runs it beside its CPU hog. Exit status 0 whatever failed (the counts are the result);
2 when the loop itself could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_interactive.pool import _cell_imports

#: Installed modules a warm start's cell imports (the forker imports them before it forks).
WARM_CELL = "import decimal, fractions, email.parser, xml.dom.minidom"
_MESSAGE_LINES = 12


@dataclass
class Count:
    """The starts of one size and kind: how many ran, which failed and why."""

    size: int
    kind: str
    starts: int = 0
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    retries: list[str] = field(default_factory=list)
    #: Starts whose client missed registrations the controller had (and took a new one).
    missed: int = 0

    def line(self) -> str:
        slowest = f", slowest {max(self.seconds):.1f} s" if self.seconds else ""
        return (
            f"{self.size} ranks, {self.kind}: {len(self.failures)} of {self.starts} starts "
            f"failed, {len(self.retries)} engine(s) retried, {self.missed} client(s) "
            f"replaced for missed registrations{slowest}"
        )


def _first_lines(text: str) -> str:
    return "\n".join(text.splitlines()[:_MESSAGE_LINES])


@dataclass
class Outcome:
    """One start: its seconds, the first lines of its error (``None``: it started), the
    retries it announced (lines of its output) and whether its client missed
    registrations (the pool's debug record says so)."""

    seconds: float
    failure: str | None
    retries: list[str]
    missed: bool = False


class _MissedRegistrations(logging.Handler):
    """Counts the pool's records of a client replaced because it missed registrations."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "a new client takes over" in record.getMessage():
            self.count += 1


_missed = _MissedRegistrations()


def one_start(size: int, kind: str, timeout: float) -> Outcome:
    """One start of ``size`` CPU ranks of ``kind``, stopped again."""
    from fsdp_interactive.pool import Pool

    shown = io.StringIO()  # the start's progress line and notices
    missed_before = _missed.count
    pool = Pool(size, devices="cpu", timeout=timeout, show_topology=False)
    began = time.monotonic()
    failure = None
    try:
        with contextlib.redirect_stdout(shown):
            pool.start()
            if kind == "warm":
                pool.run(WARM_CELL, stream=False)
                for forker in pool._processes.forkers.forkers():
                    forker.wait_warm(_cell_imports.import_specs(WARM_CELL), timeout=60)
                began = time.monotonic()
                pool.restart()
    except Exception as error:
        failure = _first_lines(f"{type(error).__name__}: {error}")
    finally:
        seconds = time.monotonic() - began
        pool.stop()
    retries = [line for line in shown.getvalue().splitlines() if "once more" in line]
    return Outcome(seconds, failure, retries, missed=_missed.count > missed_before)


def run_loop(sizes: list[int], starts: int, timeout: float) -> list[Count]:
    counts = []
    for size in sizes:
        for kind in ("cold", "warm"):
            count = Count(size, kind)
            for _ in range(starts):
                outcome = one_start(size, kind, timeout)
                count.starts += 1
                count.seconds.append(round(outcome.seconds, 1))
                count.retries += outcome.retries
                count.missed += outcome.missed
                for line in outcome.retries:
                    print(f"  {size} ranks, {kind}: {line}", flush=True)
                if outcome.failure is not None:
                    count.failures.append(outcome.failure)
                    first = outcome.failure.splitlines()[0]
                    print(f"  {size} ranks, {kind}: FAILED: {first}", flush=True)
            print(count.line(), flush=True)
            counts.append(count)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.start_loop", description=__doc__)
    parser.add_argument("--sizes", default="4,8", help="ranks per start, comma-separated")
    parser.add_argument("--starts", type=int, default=5, help="starts per size and kind")
    parser.add_argument("--timeout", type=float, default=120.0, help="each start's timeout")
    parser.add_argument("--json", type=Path, default=None, help="write the counts here")
    args = parser.parse_args(argv)
    try:
        sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    except ValueError:
        parser.error(f"--sizes must be numbers like 4,8, got {args.sizes!r}")
    if not sizes or min(sizes) < 1 or args.starts < 1:
        parser.error("--sizes and --starts must be at least 1")
    # The loop starts more ranks than this machine may have cores, on purpose.
    os.environ.setdefault("FSDPI_OVERSUBSCRIBE", "1")
    registration = logging.getLogger("fsdp_interactive.pool._registration")
    registration.setLevel(logging.DEBUG)
    registration.addHandler(_missed)
    counts = run_loop(sizes, args.starts, args.timeout)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(c) for c in counts], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
