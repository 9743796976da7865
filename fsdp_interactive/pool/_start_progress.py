"""What a pool start shows while it runs: its phases, from its first moment.

A start takes seconds (minutes on a loaded machine, or with many ranks); the user sees
where it is: the controller starting, then up; engines ``k/N`` registered; the group
forming, then formed. One line moves in place on stdout, rewritten with a carriage
return (:class:`fsdp_interactive._status_line.StatusLines`): in a terminal, and in a
notebook, whose front ends rewrite a stream's line the same way (the line a saved
notebook keeps is the last one). It ends as one ordinary line with each phase's
duration (or, for a start that fails, the phase it failed in); a notice (an engine
retried) is written above it. When the pool shows its log records, which come on
stderr between the phases, each phase is a line of its own instead.

The first line is written before anything is started. Not done here: deciding the
phases (the start does, :meth:`pool.Pool.start`).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from fsdp_interactive._status_line import StatusLines

_KEY = "start"


class StartProgress:
    """The phases of one start, shown on ``stream`` (default: the current ``sys.stdout``).

    ``what``: the ranks being started ("4 CPU ranks"); ``moving``: one line rewritten in
    place (else one line per phase); ``shown``: ``False`` shows nothing (notices still are).
    """

    def __init__(
        self,
        what: str,
        *,
        shown: bool = True,
        moving: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self._what = what
        self._shown = shown
        self._moving = moving
        self._stream = stream
        self._status = StatusLines(lambda _: self._out())
        self.began = time.monotonic()
        self._done: list[str] = []  # finished phases, with their durations
        self._phase_began = self.began
        self._last = ""

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _show(self, text: str) -> None:
        if not self._shown or text == self._last:
            return
        self._last = text
        line = f"starting {self._what}: {text}"
        if self._moving:
            self._status.update(_KEY, "stdout", line)
        else:
            self._status.write("stdout", line + "\n")

    def _finish_phase(self, name: str, seconds: float | None = None) -> float:
        """End the phase ``name`` (``seconds``: its duration, when known better than
        from the last phase's end); its duration."""
        now = time.monotonic()
        if seconds is None:
            seconds = now - self._phase_began
        self._phase_began = now
        self._done.append(f"{name} {seconds:.1f} s")
        return seconds

    def controller_starting(self, connecting: bool = False) -> None:
        """The first line, before anything starts."""
        self._show("connecting to the cluster" if connecting else "starting the controller")

    def controller_up(self, seconds: float | None = None, connecting: bool = False) -> None:
        """The controller answers (``seconds``: how long it took, when known)."""
        self._finish_phase("connected" if connecting else "controller up", seconds)

    def registered(self, count: int, n: int | None) -> None:
        """``count`` of ``n`` engines registered (``None``: as many as there are);
        called whenever the count changes."""
        head = f"{self._done[-1]}; " if self._done else ""
        counted = f"{min(count, n)}/{n}" if n is not None else str(count)
        self._show(f"{head}engines {counted} registered")

    def engines_up(self, n: int) -> None:
        seconds = self._finish_phase("engines registered")
        self._show(f"engines {n}/{n} registered ({seconds:.1f} s); forming the group")

    def notice(self, text: str) -> None:
        """An ordinary line above the moving one (shown whatever ``shown`` says)."""
        if self._moving and self._shown:
            self._status.write("stdout", text.rstrip("\n") + "\n")
        else:
            out = self._out()
            out.write(text.rstrip("\n") + "\n")
            out.flush()

    def formed(self) -> None:
        """The group formed: the moving line becomes the summary line."""
        self._finish_phase("group formed")
        total = time.monotonic() - self.began
        self._end(f"started {self._what} in {total:.1f} s: {', '.join(self._done)}")

    def failed(self) -> None:
        """The start failed (its error follows): the last phase shown stays, with the time."""
        total = time.monotonic() - self.began
        last = self._last or "before the controller started"
        self._end(f"starting {self._what}: {last}; gave up after {total:.1f} s")

    def _end(self, text: str) -> None:
        if not self._shown:
            return
        if self._moving:
            self._status.end(_KEY, "stdout", text)
        else:
            self._status.write("stdout", text + "\n")


def describe_ranks(n: int | None, devices: object, backend: str | None) -> str:
    """``4 CPU ranks``, ``2 CUDA ranks``, ``3 ranks`` (devices not decided yet), ``ranks``
    (as many as a connected cluster has)."""
    count = f"{n} " if n is not None else ""
    plural = "rank" if n == 1 else "ranks"
    if devices is None and backend == "gloo":
        return f"{count}CPU {plural}"
    if isinstance(devices, tuple) or devices == "local_rank":
        return f"{count}CUDA {plural}"
    return f"{count}{plural}"
