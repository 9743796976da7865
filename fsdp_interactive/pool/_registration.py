"""Waiting for a start's engines to register: the count the controller vouches for, the
engines that do not come, one more try for each of those, and what a start that gives
up says about them.

**Counting.** ipyparallel's ``Client`` (checked on 9.2.0) learns of engines from its
connection reply (those registered by then) and afterwards from the controller's
registration notifications, on a PUB/SUB socket that it subscribes to only after that
reply. A registration the controller completes in between is never the client's: the
start waited out its timeout with "only 3 of 4 engines registered", the fourth engine
alive, idle and registered as far as the controller knew. The pool's client connects
while its forked engines register, so this happened now and then on two loaded cores
(2 of 40 starts in ``make test-stress``'s start loop, 3 of 11 in a first loop). While the client's count lags, the wait therefore asks the controller
every :data:`PROBE_EVERY_S` seconds through a new client, whose connection reply lists
every registered engine, and keeps the new client when it knows more (the old one is
closed); the count converges whatever notifications were lost.

**Lost engines.** An engine that exits before registering, or that is still missing
half-way through the timeout after registrations stopped coming for a quarter of it (at
the latest when the timeout passes) while other engines registered, is lost to
something outside the pool (the machine: memory, an overloaded host, a registration the
controller dropped). Where its launcher can start one engine on its own (the pool's
forked engines, on this host and over ssh), the start retries each such engine once: it
says so, ends it, forks one in its place, and gives the new one at least half the
timeout (so a start that retries may take up to half its timeout longer). When no engine
registered at all, no silent engine is retried: the cause is not one engine.

**Giving up.** The error names every engine that did not register
(:mod:`.processes._engine_report`): its index, pid and host; whether it runs, ended (its
exit status) or never started; where a running one is (its stack, read with py-spy,
since it has no diagnostics agent yet) and the last lines of its log; and the engine it
replaced, if it was a retry. The first :data:`SHOWN_IN_FULL` engines are shown so, the
others one line each.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from fsdp_interactive.pool.errors import PoolStartError
from fsdp_interactive.pool.processes._engine_report import EngineReport
from fsdp_interactive.pool.processes._forked_launcher import REPLACEMENT_SUFFIX
from fsdp_interactive.pool.processes._launched import LaunchedProcesses
from fsdp_interactive.pool.rank import _bootstrap as rank_side

log = logging.getLogger(__name__)

#: Seconds between two checks of the client's count against the controller's.
PROBE_EVERY_S = 1.0
#: Longest wait for a probe's connection reply.
_PROBE_TIMEOUT_S = 5.0
_POLL_S = 0.02
#: How long the registered engines get to say which processes they are.
_DESCRIBE_WAIT_S = 5.0
#: Engines a start's error shows with their stacks and logs; the others get a line each.
SHOWN_IN_FULL = 4


class Registration:
    """One start's wait for ``n`` engines of ``client`` (see the module's docstring).

    ``reconnect(timeout)`` returns a new client of the same cluster; ``launched``: the
    processes the pool started (``None`` for a cluster it connected to: nothing is
    retried or reported per engine); ``on_count(count)`` is called whenever the count
    changes, ``notice(text)`` for what the user is told on the way (a retry).
    """

    def __init__(
        self,
        client: Any,
        n: int,
        *,
        timeout: float,
        reconnect: Callable[[float], Any] | None,
        launched: LaunchedProcesses | None,
        on_count: Callable[[int], None] | None = None,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.n = n
        self.timeout = timeout
        self._reconnect = reconnect
        self._launched = launched
        self._on_count = on_count or (lambda count: None)
        self._notice = notice or (lambda text: print(text, flush=True))
        #: Identifiers of the engines started again, and what the first one was.
        self.retried: dict[str, EngineReport] = {}
        self._began = time.monotonic()

    def wait(self, deadline: float) -> Any:
        """Wait until ``n`` engines registered (``deadline``: a ``time.monotonic()``, moved
        on by a retry); the client that counted them (the pool's from now on)."""
        began = now = self._began = time.monotonic()
        count, changed_at, next_probe = -1, now, now + PROBE_EVERY_S
        silent_checked = False
        while True:
            ids = len(self.client.ids)
            if ids != count:
                count, changed_at = ids, time.monotonic()
                self._on_count(count)
            if count >= self.n:
                break
            deadline = self._retry_exited(deadline)
            self._check_launch(count)
            now = time.monotonic()
            if now >= next_probe:
                self._probe()
                next_probe = time.monotonic() + PROBE_EVERY_S
                continue
            # A silent engine is retried once registrations stopped coming, at the latest
            # at the deadline (a start retries before it gives up).
            stalled = now - began >= self.timeout / 2 and now - changed_at >= self.timeout / 4
            if not silent_checked and count > 0 and (stalled or now > deadline):
                silent_checked = True
                log.debug(
                    "%d of %d engines registered, the last %.1fs ago",
                    count,
                    self.n,
                    now - changed_at,
                )
                deadline = self._retry_silent(deadline)
                continue
            if now > deadline:
                raise PoolStartError(self._timeout_message(count))
            time.sleep(_POLL_S)
        log.debug("%d engines registered in %.2fs", self.n, time.monotonic() - began)
        if self._launched:
            self._launched.record()  # nannies and children that came up since the launch
        return self.client

    # ------------------------------------------------------------------ counting

    def _probe(self) -> None:
        """Ask the controller, through a new client, which engines registered; keep that
        client when it knows more than ours."""
        if self._reconnect is None:
            return
        try:
            fresh = self._reconnect(_PROBE_TIMEOUT_S)
        except Exception as exc:  # the controller did not answer: the timeout decides
            log.debug("the controller did not answer a probe: %s", exc)
            return
        known, theirs = len(self.client.ids), len(fresh.ids)
        if theirs > known:
            log.debug(
                "the controller has %d engines registered, the client heard of %d: "
                "its notifications were lost; a new client takes over",
                theirs,
                known,
            )
            fresh, self.client = self.client, fresh
        with contextlib.suppress(Exception):
            fresh.close()

    # ------------------------------------------------------------------ lost engines

    def _check_launch(self, count: int) -> None:
        launched = self._launched
        problem = launched.launch_problem() if launched else None
        if problem:
            raise PoolStartError(
                f"{count} of {self.n} engines registered, and no more can: {problem}"
            )

    def _retry_exited(self, deadline: float) -> float:
        """Start again, once, each engine that exited before registering; raise when one
        cannot be. The new deadline."""
        launched = self._launched
        if launched is None:
            return deadline
        for engine in launched.exited_engines():
            report = launched.report(engine.launcher)
            if not self._may_retry(engine.launcher):
                raise PoolStartError(self._exited_message(report))
            deadline = self._retry(engine.launcher, report, "exited before registering", deadline)
        return deadline

    def _retry_silent(self, deadline: float) -> float:
        """Start again, once, each engine still missing when registrations stopped coming."""
        launched = self._launched
        if launched is None:
            return deadline
        waited = time.monotonic() - self._began
        for launcher, report in launched.unregistered(self._registered_pids(), full=SHOWN_IN_FULL):
            if not self._may_retry(launcher):
                continue
            if report.running:
                why = f"did not register within {waited:.0f}s while the others did"
            else:
                why = "exited before registering" if report.status else f"was {report.state}"
            deadline = self._retry(launcher, report, why, deadline)
        return deadline

    def _may_retry(self, launcher: Any) -> bool:
        launched = self._launched
        index = str(getattr(launcher, "identifier", ""))
        # A replacement is not replaced again: each engine is retried once.
        return (
            launched is not None
            and not index.endswith(REPLACEMENT_SUFFIX)
            and launched.can_replace(launcher)
        )

    def _retry(self, launcher: Any, report: EngineReport, why: str, deadline: float) -> float:
        """End ``launcher``'s engine, start one in its place; say so. The new deadline."""
        assert self._launched is not None
        self._notice(f"{report.title()} {why} ({_state_words(report)}); starting it once more")
        log.info("retrying engine %s:\n%s", report.index, report.text())
        replacement = self._launched.replace_engine(launcher, timeout=self.timeout)
        self.retried[str(replacement.identifier)] = report
        return max(deadline, time.monotonic() + self.timeout / 2)

    def _registered_pids(self) -> set[int]:
        """The pids the registered engines give for themselves and their parents (a
        registered engine that does not answer within a few seconds is left out)."""
        client = self.client
        if not client.ids:
            return set()
        handles = {
            eid: client[eid].apply_async(rank_side.describe_engine, False) for eid in client.ids
        }
        end = time.monotonic() + _DESCRIBE_WAIT_S
        pids: set[int] = set()
        for handle in handles.values():
            with contextlib.suppress(Exception):
                handle.wait(max(0.0, end - time.monotonic()))
                if handle.ready() and handle.successful():
                    info = handle.get(0)
                    pids.update(int(info.get(k) or 0) for k in ("pid", "parent_pid"))
        pids.discard(0)
        return pids

    # ------------------------------------------------------------------ messages

    def _retries_text(self, reports: list[EngineReport]) -> str:
        """What the engines that the missing ones replaced were, for the error."""
        lines = []
        for report in reports:
            first = self.retried.get(report.index)
            if first is not None:
                lines.append(f"engine {report.index} was the retry of:\n{first.text()}")
        return "\n".join(lines)

    def _timeout_message(self, count: int) -> str:
        retried = len(self.retried)
        head = (
            f"only {count} of {self.n} engines registered within timeout={self.timeout:g}s"
            + (f" ({retried} started once more, see below)" if retried else "")
            + "; everything started was stopped"
        )
        launched = self._launched
        if launched is None:
            return head
        began = time.monotonic()
        registered = self._registered_pids()
        asked = time.monotonic()
        found = launched.unregistered(registered, full=SHOWN_IN_FULL)
        reports = [report for _, report in found]
        log.debug(
            "the registered engines answered in %.2fs; %d reports taken in %.2fs",
            asked - began,
            len(reports),
            time.monotonic() - asked,
        )
        parts = [head]
        if reports:
            parts.append("The engines that did not register:")
            parts += [report.text() for report in reports[:SHOWN_IN_FULL]]
            parts += [report.summary() for report in reports[SHOWN_IN_FULL:]]
            retries = self._retries_text(reports[:SHOWN_IN_FULL])
            if retries:
                parts.append(retries)
        state = launched.launch_state()
        if state:
            parts.append(state)
        return "\n".join(parts)

    def _exited_message(self, report: EngineReport) -> str:
        retried = self._retries_text([report])
        text = report.text() + (f"\n{retried}" if retried else "")
        return f"an engine exited before registering:\n{text}"


def _state_words(report: EngineReport) -> str:
    if report.running:
        return f"alive; {report.where}" if report.where else "alive"
    if report.status:
        return report.status
    return report.state
