"""Rank side: the world torchrun gives a script, set up on a pool's rank for a script run.

:class:`ScriptWorld` is applied when a run starts (:meth:`ScriptWorld.enter`) and undone
when it ends (:meth:`ScriptWorld.leave`); while the run is paused it stays, so that the
cells run then see what the script sees. It holds:

* the environment torchrun sets for a worker: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the host's index), ``GROUP_WORLD_SIZE``,
  ``ROLE_RANK``, ``ROLE_NAME``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_RUN_ID`` (so ``torch.distributed.is_torchelastic_launched()`` is true),
  ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
  ``TORCHELASTIC_USE_AGENT_STORE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and
  ``OMP_NUM_THREADS`` as torchrun sets it (1 when several ranks share a host and the
  variable is unset), with torch's intra-op threads set to match: float sums depend on
  the thread count, and the run is to compute what torchrun's would;
* ``sys.argv`` (the script's path, then its arguments), the script's folder first on
  ``sys.path``, the working directory;
* the pool's process group adopted: ``init_process_group(...)``, whatever its arguments,
  makes no group and returns (a backend, world size, rank or ``device_id`` other than the
  pool's is said once, in one notice); ``destroy_process_group()`` of the default group
  does nothing (a group the script made itself is destroyed); on a CUDA rank,
  ``torch.cuda.set_device`` to another device than the rank's is said and ignored (the
  pool pinned the device, and ``LOCAL_RANK`` is its index, as under torchrun).

The functions are replaced on ``torch.distributed`` and ``torch.distributed.distributed_c10d``
(where scripts and libraries look them up), and on ``torch.cuda``; ``from
torch.distributed import init_process_group`` inside the script gets the replacement too.
A library that bound the originals before the run (none of torch, accelerate,
transformers or Lightning does) would still call them.

Faults: a rank that dies takes its world with it; a run that ends by error or interrupt
undoes the world as a normal end does.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: Shown once per run when the script asked for another group than the pool's.
NOTICE_PREFIX = "[fsdp_interactive]"


@dataclass(frozen=True)
class Place:
    """Where this rank stands, as torchrun would say it: ``rank``, ``world_size``,
    ``local_rank``, ``local_world_size``, ``group_rank`` (its host's index among the pool's
    hosts), ``group_world_size`` (hosts), ``master_addr``, ``master_port``, ``run_id``,
    ``device`` (``"cpu"`` or ``"cuda:N"``), ``backend``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: str
    run_id: str
    device: str
    backend: str


def torchrun_environment(place: Place, inherited: Mapping[str, str]) -> dict[str, str]:
    """The variables torchrun sets for this worker (``inherited``: the rank's
    environment before the run, for the variables torchrun passes through)."""
    env = {
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_RANK": str(place.group_rank),
        "GROUP_WORLD_SIZE": str(place.group_world_size),
        "ROLE_RANK": str(place.rank),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(place.world_size),
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": place.master_port,
        "TORCHELASTIC_RUN_ID": place.run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": inherited.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    threads = inherited.get("OMP_NUM_THREADS")
    if threads:
        env["OMP_NUM_THREADS"] = threads
    elif place.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass
class _Saved:
    env: dict[str, str | None] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    path: list[str] = field(default_factory=list)
    cwd: str = ""
    threads: int | None = None
    functions: list[tuple[Any, str, Any]] = field(default_factory=list)


class ScriptWorld:
    """The world of one script run on this rank (module docstring).

    ``path``: the script (absolute), ``args``: its arguments, ``cwd``: its working
    directory, ``place``: where this rank stands. ``say(text)`` shows a notice (the rank's
    stderr, which the notebook shows). ``set_environment``: set torchrun's variables (not
    under torchrun itself, which set them: an exported job).
    """

    def __init__(
        self,
        path: str,
        args: list[str],
        cwd: str,
        place: Place,
        say: Callable[[str], None] | None = None,
        *,
        set_environment: bool = True,
    ) -> None:
        self.set_environment = set_environment
        self.path = path
        self.args = list(args)
        self.cwd = cwd
        self.place = place
        self._say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self._saved: _Saved | None = None
        self._noticed: set[str] = set()

    @property
    def entered(self) -> bool:
        return self._saved is not None

    def enter(self) -> None:
        """Apply the world; ``FileNotFoundError`` (nothing changed) when the working
        directory does not exist on this rank's host."""
        if self._saved is not None:
            return
        if not os.path.isdir(self.cwd):
            raise FileNotFoundError(
                f"the working directory {self.cwd} does not exist on this rank's host; "
                "give one that does (cwd=...)"
            )
        import torch

        saved = _Saved(argv=list(sys.argv), path=list(sys.path), cwd=os.getcwd())
        env = torchrun_environment(self.place, os.environ)
        for key, value in env.items() if self.set_environment else ():
            saved.env[key] = os.environ.get(key)
            os.environ[key] = value
        threads = env.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) != torch.get_num_threads():
            saved.threads = torch.get_num_threads()
            torch.set_num_threads(int(threads))
        sys.argv[:] = [self.path, *self.args]
        sys.path.insert(0, os.path.dirname(self.path))
        os.chdir(self.cwd)
        self._saved = saved
        self._replace_functions(saved)
        log.debug("script world entered: %s %s in %s", self.path, self.args, self.cwd)

    def leave(self) -> None:
        """Undo everything :meth:`enter` did (idempotent)."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        for owner, name, original in reversed(saved.functions):
            setattr(owner, name, original)
        for key, value in saved.env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if saved.threads is not None:
            import torch

            torch.set_num_threads(saved.threads)
        sys.argv[:] = saved.argv
        sys.path[:] = saved.path
        try:
            os.chdir(saved.cwd)
        except OSError as error:  # the folder went away meanwhile
            log.warning("could not go back to %s: %s", saved.cwd, error)
        log.debug("script world left: %s", self.path)

    # ------------------------------------------------------------------ adopted functions

    def _replace_functions(self, saved: _Saved) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        init, destroy = c10d.init_process_group, c10d.destroy_process_group
        adopted_init = self._adopting_init(init)
        adopted_destroy = self._keeping_destroy(destroy)
        for owner in (dist, c10d):
            for name, replacement in (
                ("init_process_group", adopted_init),
                ("destroy_process_group", adopted_destroy),
            ):
                saved.functions.append((owner, name, getattr(owner, name)))
                setattr(owner, name, replacement)
        if self.place.device.startswith("cuda"):
            saved.functions.append((torch.cuda, "set_device", torch.cuda.set_device))
            torch.cuda.set_device = self._pinned_set_device(torch.cuda.set_device)

    def _notice_once(self, key: str, text: str) -> None:
        if key not in self._noticed:
            self._noticed.add(key)
            self._say(f"{NOTICE_PREFIX} {text}")

    def _adopting_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        import inspect

        signature = inspect.signature(original)
        place = self.place

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = dict(kwargs)
            asked = _differences(bound, place)
            if asked:
                self._notice_once(
                    "init",
                    f"init_process_group({', '.join(asked)}): the pool's group is used "
                    f"instead (backend {place.backend}, {place.world_size} ranks, this rank "
                    f"{place.rank} on {place.device}); no second group was made",
                )
            else:
                log.debug("init_process_group adopted the pool's group")

        init_process_group.__doc__ = original.__doc__
        init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        return init_process_group

    @staticmethod
    def _keeping_destroy(original: Callable[..., Any]) -> Callable[..., Any]:
        def destroy_process_group(group: Any = None) -> None:
            import torch.distributed as dist

            if group is None or group is dist.group.WORLD:
                log.debug("destroy_process_group: the pool's group stays")
                return
            original(group)

        destroy_process_group.__doc__ = original.__doc__
        destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        return destroy_process_group

    def _pinned_set_device(self, original: Callable[[Any], None]) -> Callable[[Any], None]:
        import torch

        pinned = torch.device(self.place.device)

        def set_device(device: Any) -> None:
            asked = _as_cuda_device(device)
            if asked is not None and asked != pinned.index:
                self._notice_once(
                    "set_device",
                    f"torch.cuda.set_device({device!r}): this rank stays on {pinned} "
                    f"(LOCAL_RANK={self.place.local_rank}, the device the pool pinned)",
                )
            original(pinned)

        set_device.__doc__ = original.__doc__
        set_device.__wrapped__ = original  # type: ignore[attr-defined]
        return set_device

    def pin_thread_device(self) -> None:
        """Make the calling thread's current CUDA device the rank's (it is per thread)."""
        if self.place.device.startswith("cuda"):
            import torch

            original = getattr(torch.cuda.set_device, "__wrapped__", torch.cuda.set_device)
            original(torch.device(self.place.device))


def _as_cuda_device(device: Any) -> int | None:
    """The CUDA index ``device`` names (an int, ``"cuda:1"``, ``torch.device``), or None."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    index = getattr(device, "index", None)
    if index is not None:
        return int(index)
    if isinstance(device, str) and ":" in device:
        tail = device.rsplit(":", 1)[1]
        return int(tail) if tail.isdigit() else None
    return None


def _backend_matches(asked: Any, place: Place) -> bool:
    """Whether the backend a script asked for is the pool's (``None``: torch's choice;
    ``"cpu:gloo,cuda:nccl"``: the entry for the rank's device type)."""
    if asked is None:
        return True
    text = str(getattr(asked, "value", asked)).lower()
    if ":" in text:
        wanted = "cuda" if place.device.startswith("cuda") else "cpu"
        entries = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
        text = entries.get(wanted, "")
    return text == place.backend.lower()


def _differences(bound: Mapping[str, Any], place: Place) -> list[str]:
    """What the script's ``init_process_group`` arguments ask for beyond the pool's group."""
    asked = []
    backend = bound.get("backend")
    if not _backend_matches(backend, place):
        asked.append(f"backend={backend!r}")
    for key, ours in (("world_size", place.world_size), ("rank", place.rank)):
        value = bound.get(key)
        if isinstance(value, int) and value != -1 and value != ours:
            asked.append(f"{key}={value}")
    device = bound.get("device_id")
    if device is not None:
        import torch

        pinned = torch.device(place.device)
        given = torch.device(device) if not isinstance(device, int) else None
        index = _as_cuda_device(device)
        same = (
            given is not None and given.type == pinned.type and (index in (None, pinned.index))
        ) or (given is None and pinned.type == "cuda" and index == pinned.index)
        if not same:
            asked.append(f"device_id={device!r}")
    return asked
