"""The engine forkers of one pool, one per host, kept from one group to the next.

A pool forks its engines from an :mod:`._engine_forker` on each host: on this host a
child process, on an ssh host a process reached through one ``ssh`` command
(:mod:`._ssh_forked_launcher`). :class:`HostForkers` starts them, hands the running one
of a host back to the next group (a restart, or the group after a rank died), replaces
one that ended or must run another command, and ends them all at once for ``stop()``.
Each forker is given the pool's snapshot root (on its stdin, :mod:`._forker_setup`),
which it creates on its host as it starts and removes when it exits. A forker that
replaces one of the same host may adopt the root the one before made (a private folder
of this user only); the first forker of a host refuses any folder already there.

Faults: a forker that ends while the pool runs (the OOM killer, a ``kill -9``; its host
stays up) leaves the engines it forked running, but nobody to fork the next group or to
remove the snapshot root on its host when the pool stops; :meth:`HostForkers.replace_ended`
starts a new one there, with the same command, and says which ended and how.

Not done: ending single forkers (a host no longer used keeps its forker until ``stop()``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fsdp_interactive.pool.processes._forked_launcher import EngineForker, forker_command
from fsdp_interactive.pool.processes._forker_setup import ForkerSetup

log = logging.getLogger(__name__)

#: The key of this host's forker; an ssh host's is its key in ``SSHEngineSetLauncher.engines``.
LOCAL = ""


@dataclass(frozen=True)
class EndedForker:
    """A forker that ended while the pool ran: its ``host`` key (:data:`LOCAL`: this
    host), local ``pid`` (an ssh host's: its ssh client), exit ``status`` as
    ``subprocess`` reports it (negative: killed by that signal; over ssh, ssh's own) and
    the pid of the one that took its place."""

    host: str
    pid: int
    status: int | None
    new_pid: int


class HostForkers:
    """The running forkers of one pool by host key (:data:`LOCAL` for this host's), each
    given ``snapshot_root``."""

    def __init__(self, snapshot_root: str | None = None) -> None:
        self.snapshot_root = snapshot_root
        self._forkers: dict[str, EngineForker] = {}
        self._starts: dict[str, Callable[[], EngineForker]] = {}
        #: Hosts whose forker was started since the last close (their root may exist).
        self._rooted: set[str] = set()

    def pids(self) -> list[int]:
        """Local pids of the forkers (an ssh host's: its ssh client)."""
        return [forker.pid for forker in self._forkers.values()]

    def local(self, log_dir: str, cluster_id: str) -> EngineForker:
        """This host's forker (started now unless one runs)."""
        command = forker_command()
        path = os.path.join(log_dir, f"ipengine-forker-{cluster_id}.log")
        return self._running(
            LOCAL,
            command,
            lambda: EngineForker(path, dict(os.environ), command=command, setup=self._setup(LOCAL)),
        )

    def _setup(self, key: str) -> ForkerSetup:
        """The setup of a new forker for host ``key``: it may adopt the root only when a
        forker of this pool ran there before."""
        setup = ForkerSetup(self.snapshot_root, adopt=key in self._rooted)
        self._rooted.add(key)
        return setup

    def on_ssh_hosts(
        self, hosts: Iterable[Any], log_dir: str, cluster_id: str
    ) -> tuple[dict[str, EngineForker], set[str]]:
        """The forker of every :class:`~._ssh_forked_launcher.SSHHost` in ``hosts`` by
        host key, and the keys of those started now (a kept forker's host was checked
        when its forker started; the others are to be)."""
        forkers: dict[str, EngineForker] = {}
        started: set[str] = set()
        for host in hosts:
            command = host.forker_command()
            path = os.path.join(log_dir, f"ipengine-forker-{cluster_id}-{host.file_name}.log")

            def start(host: Any = host, command: list[str] = command, path: str = path) -> Any:
                started.add(host.key)
                return EngineForker(
                    path,
                    dict(os.environ),
                    command=command,
                    where=host.key,
                    setup=self._setup(host.key),
                )

            forkers[host.key] = self._running(host.key, command, start)
        return forkers, started

    def _running(self, key: str, command: list[str], start: Callable[[], EngineForker]) -> Any:
        """The running forker of host ``key``, started with ``start()`` unless one that
        runs ``command`` is kept."""
        forker = self._forkers.get(key)
        if forker is not None and forker.running() and forker.command == command:
            return forker
        if forker is not None:
            forker.close()
        self._starts[key] = start
        forker = self._forkers[key] = start()
        where = key or "this host"
        log.debug(
            "engine forker for %s started (pid %d); its log: %s", where, forker.pid, forker.log_path
        )
        return forker

    def replace_ended(self, skip: Iterable[str] = ()) -> list[EndedForker]:
        """Start a new forker, with the same command, on every host whose forker ended
        after it was ready, but those in ``skip`` (hosts known to be lost); one
        :class:`EndedForker` each. A forker that never got ready (its host cannot be
        reached) is left to the next group's start, which reports it."""
        ended = []
        for key, forker in list(self._forkers.items()):
            if forker.running() or not forker.ready.is_set() or key in set(skip):
                continue
            forker.close()  # reaps it (and its reader thread): nothing is left to end
            status = forker.exit_status()
            new = self._forkers[key] = self._starts[key]()
            log.debug(
                "engine forker for %s (pid %d) ended with status %s; pid %d took its place",
                key or "this host",
                forker.pid,
                status,
                new.pid,
            )
            ended.append(EndedForker(key, forker.pid, status, new.pid))
        return ended

    def warm(self, specs: list[str]) -> None:
        """Have every running forker import ``specs`` for the engines it forks later
        (:meth:`EngineForker.warm`); returns at once."""
        for forker in self._forkers.values():
            if forker.running():
                forker.warm(specs)

    def precheck(self, snapshot_id: str) -> None:
        """Have every running forker hash its host's copy of the snapshot ``snapshot_id``
        ahead of a restore (:meth:`EngineForker.precheck`); returns at once."""
        for forker in self._forkers.values():
            if forker.running():
                forker.precheck(snapshot_id)

    def forkers(self) -> list[EngineForker]:
        """The forkers started so far (running or not)."""
        return list(self._forkers.values())

    def describe(self) -> str:
        """One line: each forker, its pid and how long its imports took."""
        return ", ".join(
            f"{key or 'this host'} pid {forker.pid} (ready in {forker.ready_s or 0:.2f}s)"
            for key, forker in self._forkers.items()
        )

    def close(self) -> None:
        """End every forker through its handle: all are asked at once (each ends what it
        forked and removes its host's snapshot root), then waited for."""
        forkers, self._forkers = self._forkers, {}
        self._starts = {}
        self._rooted.clear()  # each removes its root as it ends: the next start makes them anew
        for forker in forkers.values():
            forker.begin_close()
        for key, forker in forkers.items():
            forker.close()
            log.debug("engine forker for %s (pid %d) stopped", key or "this host", forker.pid)
