"""An engine start-up with a fault injected: the pool's forked engines run this instead of
their entry (tests monkeypatch the pool's engine command), and one or more of them stall
or exit before registering; the others go on to the real entry.

``python -m tests.pool.faulty_engine ARGS`` (the entry's own arguments). Each engine claims
its turn with a file in ``$FSDPI_TEST_FAULT_DIR`` (``turn-<k>``, made with ``O_EXCL``, so
every engine gets a different ``k``, the first to start ``0``) and writes its pid and
fault into ``engine-<pid>``. ``$FSDPI_TEST_FAULT`` says which turns fail and how:

* ``stall-first``: turn 1 stalls for good (turn 0 starts normally, so one engine
  registers before it; a replacement takes turn 2 and starts normally);
* ``stall-after-first``: every turn after 0 stalls, replacements too;
* ``exit-first``: turn 0 prints a line and exits with status 3.

A stalling engine prints ``STALL_LINE`` into its log first and then waits in
:func:`stall_before_registering`, where the stack a start's error shows must find it.
"""

from __future__ import annotations

import os
import sys
import time

STALL_LINE = "faulty engine: stalling before registering"
EXIT_LINE = "faulty engine: exiting before registering"


def stall_before_registering() -> None:
    print(STALL_LINE, flush=True)
    while True:
        time.sleep(0.5)


def claim_turn(folder: str) -> int:
    turn = 0
    while True:
        try:
            os.close(os.open(os.path.join(folder, f"turn-{turn}"), os.O_CREAT | os.O_EXCL))
            return turn
        except FileExistsError:
            turn += 1


def fault_of(mode: str, turn: int) -> str | None:
    if mode == "stall-first":
        return "stall" if turn == 1 else None
    if mode == "stall-after-first":
        return "stall" if turn > 0 else None
    if mode == "exit-first":
        return "exit" if turn == 0 else None
    raise ValueError(f"unknown fault {mode!r}")


def main() -> int:
    folder = os.environ["FSDPI_TEST_FAULT_DIR"]
    fault = fault_of(os.environ["FSDPI_TEST_FAULT"], claim_turn(folder))
    with open(os.path.join(folder, f"engine-{os.getpid()}"), "w") as f:
        f.write(fault or "none")
    if fault == "stall":
        stall_before_registering()
    if fault == "exit":
        print(EXIT_LINE, flush=True)
        return 3
    from fsdp_interactive.pool.processes import _engine_entry

    return _engine_entry.main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
