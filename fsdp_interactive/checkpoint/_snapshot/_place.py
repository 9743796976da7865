"""Where snapshots live: each host's snapshot folder, the host a rank is on, and which
host keeps which rank's files (the ring).

* The folder (the *root*) is ``$FSDPI_SNAPSHOT_ROOT`` (a pool sets it for every engine,
  one per pool, in host memory), else ``/dev/shm/fsdpi-snapshots-<uid>`` (the system's
  temporary folder where there is no ``/dev/shm``). Ranks on one host share it; ranks on
  different hosts have different physical folders at the same path. It must be a
  private folder of this user (mode 0700, not a link; :func:`private_root`), made here
  when missing: a root someone else made is refused before anything is read from it or
  written to it. The default path can be guessed, and another user who makes it first
  (``/dev/shm`` is sticky: the owner cannot remove it) would deny snapshots for good; so
  where the default path is taken by something that is not this user's private folder,
  the root is ``/dev/shm/fsdpi-snapshots-<uid>-<12 hex digits>`` instead, the digits
  derived from this user's checkpoint key (:mod:`fsdp_interactive.checkpoint._format._owner_key`):
  the same on every rank and in every later process of the user, unknown to anyone else.
  The first use in a process says so (a warning naming both folders).
* The host of a rank is ``$FSDPI_SNAPSHOT_HOST`` when set, else ``socket.gethostname()``.
  The variable exists so that tests can place the ranks of one machine on simulated
  hosts (each with its own root); a pool never sets it.
* The hosts are ordered as their names first appear in rank order. Every host keeps its
  own ranks' files and a copy of the files of the host before it, so that with two or more
  hosts losing one host loses no file. One host keeps only its own.

Nothing here talks to other ranks, except :func:`snapshot_ranks` which creates the
snapshot's gloo group on first use (collectively).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fsdp_interactive import _private_files
from fsdp_interactive._background_groups import background_gloo_group
from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint._format import _owner_key
from fsdp_interactive.checkpoint.errors import SnapshotError

logger = logging.getLogger(__name__)

ROOT_ENV = "FSDPI_SNAPSHOT_ROOT"
HOST_ENV = "FSDPI_SNAPSHOT_HOST"
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def default_root() -> Path:
    """The root used when ``FSDPI_SNAPSHOT_ROOT`` is not set: host memory when it can."""
    base = Path("/dev/shm")
    if not base.is_dir():
        base = Path(tempfile.gettempdir())
    return base / f"fsdpi-snapshots-{os.getuid()}"


def root_folder(root: str | os.PathLike | None = None) -> Path:
    """``root`` if given, else ``$FSDPI_SNAPSHOT_ROOT``, else :func:`default_root` or, when
    that path is taken by something that is not this user's private folder,
    :func:`fallback_root` (absolute)."""
    if root is None:
        root = os.environ.get(ROOT_ENV) or _unsquatted(default_root())
    return Path(root).absolute()


def fallback_root(default: Path) -> Path:
    """The root used where ``default`` is taken: its name and 12 hex digits derived from
    this user's checkpoint key (see the module)."""
    key = _owner_key.owner_key()
    tag = hmac.new(key, b"fsdp-interactive snapshot root", hashlib.sha256).hexdigest()[:12]
    return default.with_name(f"{default.name}-{tag}")


_WARNED: set[Path] = set()


def _unsquatted(default: Path) -> Path:
    """``default``, unless it exists and is not a private folder of this user: then
    :func:`fallback_root`, said once per process (``logging`` warning)."""
    try:
        _private_files.check_private_folder(default)
        return default
    except FileNotFoundError:
        return default
    except _private_files.NotPrivateError as exc:
        try:
            fallback = fallback_root(default)
        except _owner_key.OwnerKeyError:
            return default  # refused with its reason by private_root
        if default not in _WARNED:
            _WARNED.add(default)
            logger.warning(
                "the default snapshot folder %s %s (another user may have made it first); "
                "snapshots go to the private folder %s instead (set %s to choose one)",
                default,
                exc.reason,
                fallback,
                ROOT_ENV,
            )
        return fallback


def private_root(root: str | os.PathLike | None = None, *, create: bool = True) -> Path | None:
    """:func:`root_folder`, checked to be a private folder of this user (made so when it is
    missing and ``create``; ``None`` when it is missing and not ``create``).

    Raises :class:`SnapshotError` naming the folder, what is wrong with it and what to do,
    when it is not one (another user's, a link, other users may enter it).
    """
    folder = root_folder(root)
    try:
        if create:
            folder.parent.mkdir(parents=True, exist_ok=True)
            _private_files.make_private_folder(folder, exist_ok=True)
        else:
            _private_files.check_private_folder(folder)
    except FileNotFoundError:
        if create:
            raise
        return None
    except _private_files.NotPrivateError as exc:
        raise SnapshotError(
            f"refusing the snapshot folder {exc.path}: it {exc.reason}. Snapshots live only "
            "in a folder of this user's, mode 0700: another user may have made this one "
            f"first. Remove it if it is yours (chmod 700 keeps it), or set {ROOT_ENV} to "
            "another folder"
        ) from None
    return folder


def host_name() -> str:
    """The host this rank's snapshot files live on (``$FSDPI_SNAPSHOT_HOST`` or the
    machine's host name)."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def rank_of_file(name: str) -> int | None:
    """The rank that wrote a DCP data file (``__3_0.distcp`` -> 3); ``None`` for others."""
    found = _DATA_FILE.match(name)
    return int(found.group(1)) if found else None


def snapshot_ranks() -> Ranks:
    """The ranks as the snapshot's collectives see them: the default group's ranks over a
    gloo group of their own (also on NCCL pools: files travel as CPU tensors, and a
    background snapshot's collectives never mix with training's). Creating the group is
    collective on first use; one process alone is a world of one."""
    group = background_gloo_group("snapshot")
    return Ranks(group) if group is not None else Ranks(local=True)


@dataclass(frozen=True)
class Hosts:
    """The host of every rank (``of_rank[r]``), and what follows from it."""

    of_rank: tuple[str, ...]

    @cached_property
    def order(self) -> tuple[str, ...]:
        """Hosts in the order their names first appear in rank order."""
        return tuple(dict.fromkeys(self.of_rank))

    def ranks_on(self, host: str) -> list[int]:
        return [r for r, h in enumerate(self.of_rank) if h == host]

    def leader(self, host: str) -> int:
        """The rank that creates, publishes and rotates ``host``'s folders (its lowest)."""
        return self.ranks_on(host)[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.of_rank[rank]) == rank

    def following(self, host: str) -> str | None:
        """The host that keeps a copy of ``host``'s files (``None`` with one host)."""
        if len(self.order) < 2:
            return None
        return self.order[(self.order.index(host) + 1) % len(self.order)]

    def preceding(self, host: str) -> str | None:
        """The host whose files ``host`` keeps a copy of (``None`` with one host)."""
        if len(self.order) < 2:
            return None
        return self.order[(self.order.index(host) - 1) % len(self.order)]

    def kept_ranks(self, host: str) -> list[int]:
        """The ranks whose data files ``host`` keeps: its own, then the preceding host's."""
        before = self.preceding(host)
        return self.ranks_on(host) + (self.ranks_on(before) if before is not None else [])

    def receiver(self, rank: int) -> int | None:
        """The rank on the following host that writes ``rank``'s ring copy (spread over
        that host's ranks); ``None`` with one host."""
        host = self.of_rank[rank]
        after = self.following(host)
        if after is None:
            return None
        targets = self.ranks_on(after)
        return targets[self.ranks_on(host).index(rank) % len(targets)]

    def mixed_roots(self, roots: list[str]) -> dict[str, list[str]]:
        """Hosts whose ranks use different snapshot folders (``roots[r]`` is rank ``r``'s)."""
        found = {host: sorted({roots[r] for r in self.ranks_on(host)}) for host in self.order}
        return {host: used for host, used in found.items() if len(used) > 1}

    def files_kept(self, host: str, data_files: list[str]) -> list[str]:
        """Which of a snapshot's ``data_files`` ``host`` keeps; every one for a host that
        did not take part (it got them all when a restore completed it)."""
        if host not in self.order:
            return list(data_files)
        kept = set(self.kept_ranks(host))
        return [n for n in data_files if rank_of_file(n) is None or rank_of_file(n) in kept]
