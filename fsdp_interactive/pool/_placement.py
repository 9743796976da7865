"""Where a pool's ranks go: how many, on which devices, over which backend.

Two steps. :func:`check_request` validates what the caller passed (at construction, so
bad input fails before anything starts). :func:`plan` turns it into a
:class:`Placement` when the pool starts, counting visible CUDA devices without
initialising CUDA in the calling process (:mod:`._devices`).

Not done here: choosing which engine is which rank (:mod:`._topology`) or checking a
remote host's devices (the rank does that when it joins the group).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from fsdp_interactive.pool._devices import visible_cuda_device_count

#: Devices of a placement: CUDA indices per local rank, ``"local_rank"`` (device
#: ``cuda:<local_rank>`` on every host, for engines this host cannot see) or ``None``
#: (CPU ranks).
Devices = tuple[int, ...] | Literal["local_rank"] | None


@dataclass(frozen=True)
class Request:
    """What the caller asked for, validated: ``n`` ranks (``None``: default), ``devices``
    (CUDA indices, ``"cpu"`` or ``None`` for the default) and ``backend`` (``None``: default).
    """

    n: int | None
    devices: tuple[int, ...] | Literal["cpu"] | None
    backend: Literal["gloo", "nccl"] | None


@dataclass(frozen=True)
class Placement:
    """The decided placement of one start: ``n`` ranks (``None``: every engine of a
    connected cluster), their ``devices`` and the process-group ``backend``."""

    n: int | None
    devices: Devices
    backend: Literal["gloo", "nccl"]

    def device_for(self, local_rank: int) -> str:
        """The torch device string of the rank with this ``local_rank``."""
        if self.devices is None:
            return "cpu"
        if self.devices == "local_rank":
            return f"cuda:{local_rank}"
        return f"cuda:{self.devices[local_rank]}"


def check_n(n: Any) -> int | None:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (number of ranks), got {n!r}")
    return n


def check_devices(devices: Any) -> tuple[int, ...] | Literal["cpu"] | None:
    if devices is None or devices == "cpu":
        return devices
    if isinstance(devices, str) or not isinstance(devices, Iterable):
        raise ValueError(f"devices must be a list of CUDA device indices or 'cpu', got {devices!r}")
    chosen = tuple(devices)
    if not chosen or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in chosen):
        raise ValueError(f"devices must be non-negative CUDA device indices, got {devices!r}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"devices must not repeat (one device per rank), got {devices!r}")
    return chosen


def check_request(n: Any, devices: Any, backend: Any) -> Request:
    """Validate ``n``, ``devices`` and ``backend`` together; ``ValueError`` says what is wrong."""
    n = check_n(n)
    devices = check_devices(devices)
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    if backend == "nccl" and devices == "cpu":
        raise ValueError("backend='nccl' needs CUDA devices, but devices='cpu'")
    if isinstance(devices, tuple) and n is not None:
        if n > len(devices):
            raise ValueError(
                f"n={n} ranks but only {len(devices)} devices given "
                f"(devices={list(devices)}); one device per rank"
            )
        if n < len(devices):
            raise ValueError(
                f"n={n} but {len(devices)} devices given; "
                "pass as many devices as ranks (or leave n out)"
            )
    return Request(n, devices, backend)


def plan(
    request: Request,
    *,
    local_engines: bool,
    connecting: bool,
    visible_devices: Callable[[], int] = visible_cuda_device_count,
) -> Placement:
    """Decide n, devices and backend before anything is started.

    ``local_engines``: the engines run on this host, so its visible CUDA devices are
    theirs (``visible_devices()`` counts them). ``connecting``: the pool joins a running
    cluster, where CPU ranks default to every registered engine instead of 2. Raises
    ``ValueError`` for devices that are not present or fewer devices than ranks.
    """
    n, devices, backend = request.n, request.devices, request.backend
    default_cpu_n = None if connecting else 2
    if devices == "cpu" or (devices is None and backend == "gloo"):
        return Placement(n or default_cpu_n, None, "gloo")
    visible = visible_devices() if local_engines else None
    if isinstance(devices, tuple):
        if visible is not None:
            missing = [d for d in devices if d >= visible]
            if missing:
                raise ValueError(
                    f"devices {missing} not present: {visible} CUDA device(s) visible "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
                )
        return Placement(len(devices), devices, backend or "nccl")
    if visible:
        count = n if n is not None else visible
        if count > visible:
            raise ValueError(
                f"n={count} ranks but only {visible} CUDA device(s) visible; "
                "pass devices='cpu' (or backend='gloo') for CPU ranks"
            )
        return Placement(count, tuple(range(count)), backend or "nccl")
    if visible is None and backend == "nccl":
        # Engines on other hosts: trust the caller; each rank checks its device on its host.
        return Placement(n if n is not None else 1, "local_rank", "nccl")
    if backend == "nccl":
        raise ValueError("backend='nccl' needs CUDA devices, but none are visible")
    return Placement(n or default_cpu_n, None, "gloo")
