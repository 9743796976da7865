"""Where a pool's ranks go: how many, on which devices, over which backend.

Three steps. :func:`check_request` validates what the caller passed (at construction,
so bad input fails before anything starts). :func:`plan` turns it into a
:class:`Placement` when the pool starts: for engines on this host it counts this host's
visible CUDA devices without initialising CUDA in the calling process
(:mod:`pool.processes._devices`); for engines elsewhere (another launcher, or a cluster
the pool connects to) it leaves devices and backend to :func:`settle`, which decides
from what the engines report about their own hosts (their CUDA device counts, see
:func:`pool.rank._bootstrap.describe_engine`), once they registered.

A CUDA rank sees the devices of its host's ranks, in local-rank order, and uses
``cuda:<local_rank>``: with ``devices=[1, 3]`` every engine on the host runs under
``CUDA_VISIBLE_DEVICES`` naming devices 1 and 3 (as the engines saw them), and local rank
1 computes on ``cuda:1``, which is device 3. So the index a rank sees is its local rank,
as under torchrun, and FSDP1's ``device_id=local_rank`` (or ``torch.cuda.set_device(
local_rank)``) lands on the device the pool chose.

Not done here: choosing which engine is which rank (:mod:`pool.common._topology`) or
setting the environment (the rank does that when it joins the group,
:func:`pool.rank._bootstrap.narrow_visible_devices`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fsdp_interactive.pool.processes._devices import visible_cuda_device_count

#: Devices of a placement: CUDA indices per local rank (as the engines see them),
#: ``"local_rank"`` (device ``cuda:<local_rank>`` of each host's own visible devices),
#: ``"reported"`` (not decided yet: :func:`settle` decides from the engines' reports) or
#: ``None`` (CPU ranks).
Devices = tuple[int, ...] | Literal["local_rank", "reported"] | None


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
    """The placement of one start: ``n`` ranks (``None``: every engine of a connected
    cluster), their ``devices`` and the process-group ``backend`` (``None`` while the
    devices are ``"reported"``, i.e. not decided yet)."""

    n: int | None
    devices: Devices
    backend: Literal["gloo", "nccl"] | None

    @property
    def decided(self) -> bool:
        return self.devices != "reported" and self.backend is not None

    def device_for(self, local_rank: int) -> str:
        """The torch device string of the rank with this ``local_rank``, as the rank sees
        it once it runs under :meth:`visible_for` (``cuda:<local_rank>``)."""
        if not self.decided:
            raise RuntimeError(f"placement not decided yet: {self}")
        return "cpu" if self.devices is None else f"cuda:{local_rank}"

    def visible_for(self, local_world_size: int) -> tuple[int, ...] | None:
        """The CUDA devices (indices as the engines see them) a host with
        ``local_world_size`` ranks shows each of its ranks, in local-rank order; ``None``:
        leave the host's ``CUDA_VISIBLE_DEVICES`` as it is (CPU ranks, ``"local_rank"``)."""
        if isinstance(self.devices, tuple):
            return self.devices[:local_world_size]
        return None


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
    """Decide n (and, where this host can tell, devices and backend) before anything starts.

    ``local_engines``: the pool starts its engines on this host, so this host's visible
    CUDA devices are theirs (``visible_devices()`` counts them). Otherwise (engines on
    other hosts, or a running cluster the pool connects to) devices and backend stay
    ``"reported"`` for :func:`settle`, unless the request fixes them. ``connecting``: the
    pool joins a running cluster, where the default is every registered engine instead
    of 2. Raises ``ValueError`` for devices that are not present or fewer devices than
    ranks.
    """
    n, devices, backend = request.n, request.devices, request.backend
    default_n = None if connecting else 2
    if devices == "cpu" or (devices is None and backend == "gloo"):
        return Placement(n or default_n, None, "gloo")
    if isinstance(devices, tuple):
        if local_engines:
            visible = visible_devices()
            missing = [d for d in devices if d >= visible]
            if missing:
                raise ValueError(
                    f"devices {missing} not present: {visible} CUDA device(s) visible "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
                )
        return Placement(len(devices), devices, backend or "nccl")
    if not local_engines:
        return Placement(n if n is not None else default_n, "reported", backend)
    visible = visible_devices()
    if visible:
        count = n if n is not None else visible
        if count > visible:
            raise ValueError(
                f"n={count} ranks but only {visible} CUDA device(s) visible; "
                "pass devices='cpu' (or backend='gloo') for CPU ranks"
            )
        return Placement(count, tuple(range(count)), backend or "nccl")
    if backend == "nccl":
        raise ValueError("backend='nccl' needs CUDA devices, but none are visible")
    return Placement(n or default_n, None, "gloo")


def settle(placement: Placement, hosts: Mapping[str, tuple[int, int | None]]) -> Placement:
    """The placement for the engines that registered, from what they report.

    ``hosts``: per host, ``(ranks on it, CUDA devices its engines see)`` (the count
    ``None`` when not asked). A ``"reported"`` placement becomes CUDA ranks over NCCL
    (``cuda:<local_rank>`` on every host) when every host has a device for each of its
    ranks, CPU ranks over gloo when no host has one; anything in between is refused, as
    is ``backend="nccl"`` without devices. Explicit device indices are checked against
    each host's count. Raises ``ValueError`` naming the hosts.
    """
    counts = {host: count for host, (_, count) in hosts.items()}
    ranks = {host: local for host, (local, _) in hosts.items()}
    if isinstance(placement.devices, tuple):
        devices = placement.devices
        for host in hosts:
            if ranks[host] > len(devices):
                raise ValueError(
                    f"{host} runs {ranks[host]} ranks but devices={list(devices)} names "
                    f"{len(devices)} (one device per local rank)"
                )
            count = counts[host]
            missing = [d for d in devices[: ranks[host]] if count is not None and d >= count]
            if missing:
                raise ValueError(f"devices {missing} not present on {host}: {count} CUDA device(s)")
        return placement
    if placement.devices != "reported":
        return placement
    described = ", ".join(f"{host}: {counts[host]}" for host in hosts)
    if not any(counts.values()):
        if placement.backend == "nccl":
            if all(count is None for count in counts.values()):
                # Nothing counted: trust the caller; each rank checks its device when it joins.
                return Placement(placement.n, "local_rank", "nccl")
            raise ValueError(
                f"backend='nccl' needs CUDA devices, but the engines' hosts have none "
                f"(CUDA devices per host: {described})"
            )
        return Placement(placement.n, None, "gloo")
    short = [host for host in hosts if (counts[host] or 0) < ranks[host]]
    if short:
        detail = "; ".join(
            f"{host} runs {ranks[host]} ranks and has {counts[host] or 0} CUDA device(s)"
            for host in short
        )
        raise ValueError(
            f"not every rank can have a CUDA device of its own: {detail}. Pass "
            "devices='cpu' (or backend='gloo') for CPU ranks, or start as many engines on "
            "a host as it has devices"
        )
    return Placement(placement.n, "local_rank", placement.backend or "nccl")


#: Set to 1 to start more CPU ranks than this host has cores without a warning.
OVERSUBSCRIBE_ENV = "FSDPI_OVERSUBSCRIBE"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscription(
    placement: Placement, *, local_engines: bool, allowed: bool, cores: int | None = None
) -> str | None:
    """The warning for more CPU ranks on this host than it has cores (``None``: none due).

    Every rank then gets a fraction of a core: the start, each collective and each step
    slow down in proportion, and timeouts meant for a quiet machine pass. ``allowed``:
    the caller said so (``oversubscribe=True``), or ``$FSDPI_OVERSUBSCRIBE`` is 1; engines
    on other hosts are not counted here (their cores are theirs).
    """
    if allowed or os.environ.get(OVERSUBSCRIBE_ENV, "").strip() in ("1", "true", "yes"):
        return None
    if not local_engines or placement.devices is not None or placement.n is None:
        return None
    cores = usable_cores() if cores is None else cores
    if placement.n <= cores:
        return None
    share = placement.n / cores
    return (
        f"{placement.n} CPU ranks on {cores} core{'s' if cores != 1 else ''}: each rank "
        f"gets about 1/{share:.3g} of a core, so the ranks compute about {share:.3g} times "
        "slower than with a core each, and the start and every collective wait on them "
        f"(timeouts meant for a quiet machine may pass). Start at most {cores} "
        f"rank{'s' if cores != 1 else ''}, or silence this: %fsdp start --oversubscribe, "
        f"Pool(..., oversubscribe=True), or {OVERSUBSCRIBE_ENV}=1"
    )
