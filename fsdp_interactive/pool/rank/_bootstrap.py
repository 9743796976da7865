"""Rank side of the pool: what each engine runs to become one ``torch.distributed`` rank.

The notebook side (:mod:`fsdp_interactive.pool._rendezvous`) calls these functions on
the engines through ipyparallel; they take and return plain data only. This module never
imports IPython, ipyparallel or anything notebook-side, and it never touches CUDA
unless the spec it is given names a CUDA device.

Start-up, in order:

0. :func:`enable_logging`, only when the pool has a log level: this engine's
   ``fsdp_interactive.*`` records go to its stderr, which reaches the notebook.
1. :func:`describe_engine` on every engine: host, address, pid (and, when the kernel
   cannot tell, the CUDA devices the engine sees, counted without initialising CUDA).
2. :func:`open_store` on the engine chosen as rank 0: with every rank on one host, a
   ``FileStore`` in the pool's private snapshot root (mode 0700: no other local user can
   read or change it, where a ``TCPStore`` on loopback would accept any local user);
   with ranks on several hosts, a ``TCPStore`` server on a free port of rank 0's address
   (picked by binding port 0, so no other process can take it in between), which other
   hosts must reach: torch's store authenticates nothing, so that network must be trusted
   (docs/security.md).
3. :func:`join_group` on all ranks concurrently: torchrun's environment variables,
   ``CUDA_VISIBLE_DEVICES`` narrowed to the devices of the host's ranks (so that a rank's
   local rank is the index of its device, as under torchrun) and device pinning (both
   before any other CUDA use), the flight recorder's buffer size and
   the collective checks (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` when asked for), both of
   which torch reads when the group is created, then ``init_process_group`` on the
   shared store (the pool's snapshot root, named in the environment given, is made
   first where no engine forker made it: a private folder, refused when it is not one)
   and a readiness handshake through the store (every rank counts itself
   in and waits for the full count; no sleeps), checked by one ``all_reduce``, which
   also tells whether the flight recorder records this backend. The process takes a
   title (``fsdp-interactive rank 1/4, kernel pid <pid>``) so that ``ps`` shows what it
   is (and nothing secret: every user sees it).

The diagnostics agent (:mod:`._agent`) is started by the engine's hooks
(:mod:`._engine_shell`) around this, because its key comes from the engine's session.

Not done here: choosing ranks or devices (the notebook side decides), retrying, or
recovering a broken group (the pool restarts the engines instead).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from fsdp_interactive import _private_files
from fsdp_interactive.pool.common import _hosts, _logs, _snapshot_root, _topology
from fsdp_interactive.pool.common._cuda_count import probe_count
from fsdp_interactive.pool.common._process_title import set_title
from fsdp_interactive.pool.rank import _torch_recorder

log = logging.getLogger(__name__)

#: The variables that name the interface gloo's and NCCL's sockets bind (torch reads them
#: when the group is created).
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

#: The environment variable naming the pool's snapshot root (also where a single-host
#: group's rendezvous file lives), and the name every rendezvous file there starts with.
SNAPSHOT_ROOT_ENV = _snapshot_root.ENV_VAR
STORE_FILE_PREFIX = ".rendezvous-"

_READY_KEY = "fsdp_interactive/ready"
_ALL_READY_KEY = "fsdp_interactive/all_ready"


@dataclass(frozen=True)
class JoinSpec:
    """What one engine is told to become a rank of a new group (:func:`join_group`): plain
    data the kernel makes for each rank (:mod:`fsdp_interactive.pool._rendezvous`)."""

    #: This engine's rank, and how many ranks the group has.
    rank: int
    world_size: int
    #: Its place among its host's ranks, and how many ranks its host has (``LOCAL_RANK``,
    #: ``LOCAL_WORLD_SIZE``; a CPU rank takes its share of the host's cores by them).
    local_rank: int
    local_world_size: int
    #: Rank 0's address, and the port its ``TCPStore`` listens on (``MASTER_ADDR``,
    #: ``MASTER_PORT``).
    master_addr: str
    master_port: int | None
    #: ``"gloo"`` or ``"nccl"``.
    backend: str
    #: ``"cpu"`` or ``"cuda:N"``: the rank's device, pinned before anything else uses CUDA.
    device: str
    #: Seconds the group's collectives (and the rendezvous) may wait.
    pg_timeout_s: float
    #: Extra environment variables set first (socket interface names, the pool's
    #: snapshot root).
    env: dict[str, str] = field(default_factory=dict)
    #: The rendezvous ``FileStore`` rank 0 opened (every rank on one host); ``MASTER_PORT``
    #: is then not set: nothing listens. ``None``: the ``TCPStore`` at ``master_addr``.
    store_file: str | None = None
    #: The CUDA devices of this host's ranks in local-rank order, as this engine sees them:
    #: ``CUDA_VISIBLE_DEVICES`` is narrowed to them first (:func:`narrow_visible_devices`).
    #: ``None``: left as it is.
    cuda_devices: tuple[int, ...] | None = None
    #: Entries of torch's flight recorder ring buffer (0: off; ``None``: the environment's
    #: setting).
    flight_recorder: int | None = None
    #: Check every collective's arguments across ranks (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
    check_collectives: bool = False
    #: The process title ``ps`` shows ("": left as it is).
    title: str = ""
    #: This rank's address on the pool's network: gloo and NCCL bind the interface that
    #: holds it (:func:`bind_collective_sockets`). ``None``: every rank on one host.
    socket_address: str | None = None


@dataclass
class _RankState:
    store: Any = None
    listen_socket: socket.socket | None = None
    rank: int = -1
    world_size: int = 0
    local_rank: int = -1
    device: str = "cpu"
    #: ``CUDA_VISIBLE_DEVICES`` as the engine inherited it, kept from the first time the
    #: pool narrowed it (``narrowed``); ``None``: it was not set.
    inherited_visible: str | None = None
    narrowed: bool = False


_STATE = _RankState()


def enable_logging(level: int) -> None:
    """Show this engine's ``fsdp_interactive.*`` records at ``level`` on its stderr."""
    _logs.enable(level)
    log.debug("engine pid %d logs at level %s", os.getpid(), logging.getLevelName(level))


def describe_engine(count_cuda: bool = False) -> dict[str, Any]:
    """Where this engine runs: ``host``, ``address`` (best-effort IPv4), ``pid``, the
    ``python`` executable, ``torch``'s version, ``versions``
    (:func:`pool.common._hosts.versions`), ``launch_order``, its place in the order its
    launcher started the engines, when the launcher says
    (:data:`pool.common._topology.LAUNCH_ORDER_ENV`; ``None`` otherwise), and with
    ``count_cuda``, ``cuda_devices``: how many CUDA devices this engine sees
    (:func:`cuda_device_count`), else ``None``."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = host
    try:
        import torch

        # A plain str: torch's TorchVersion would make the kernel import torch to unpickle it.
        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = None
    return {
        "host": host,
        "address": address,
        "pid": os.getpid(),
        "parent_pid": os.getppid(),
        "python": sys.executable,
        "torch": torch_version,
        "versions": _hosts.versions(),
        "cuda_devices": cuda_device_count() if count_cuda else None,
        "launch_order": _topology.launch_order(),
    }


def cuda_device_count() -> int:
    """The CUDA devices this engine sees (under its ``CUDA_VISIBLE_DEVICES``), counted
    without initialising CUDA here: through NVML, else in a short-lived subprocess. CUDA
    must stay uninitialised until :func:`join_group` has narrowed
    ``CUDA_VISIBLE_DEVICES`` (CUDA reads it once, when it initialises)."""
    from fsdp_interactive._torch_compat import cuda_device_count_without_init

    count = cuda_device_count_without_init()
    return probe_count() if count is None else count


def open_store(
    bind_address: str, world_size: int, timeout_s: float, store_file: str | None = None
) -> int:
    """Start the rendezvous store on this engine; return the ``TCPStore``'s port (0 for a
    file store).

    ``store_file``: a ``FileStore`` at that path, whose folder (the pool's snapshot root)
    is made a private folder first, or refused when it is not one; the file is made mode
    0600 (torch's store would take the umask's); other rendezvous files of earlier
    groups in it are removed. Otherwise a ``TCPStore`` server:
    ``bind_address`` is the only address it listens on (rank 0's cluster address when
    ranks live on other hosts; ``""`` would be every interface).
    """
    from torch.distributed import FileStore, TCPStore

    close_store()
    if store_file is not None:
        folder = os.path.dirname(store_file)
        _private_files.make_private_folder(folder, exist_ok=True)
        for name in os.listdir(folder):
            if name.startswith(STORE_FILE_PREFIX) and name != os.path.basename(store_file):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
        with contextlib.suppress(FileExistsError):  # mode 0600, whatever the umask
            os.close(_private_files.create_file(store_file))
        _STATE.store = FileStore(store_file, world_size)
        _STATE.store.set_timeout(timedelta(seconds=timeout_s))
        log.debug("rendezvous store in the file %s", store_file)
        return 0
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((bind_address, 0))
    listener.listen(max(64, 2 * world_size))
    port = listener.getsockname()[1]
    _STATE.listen_socket = listener
    _STATE.store = TCPStore(
        bind_address or "0.0.0.0",
        port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    log.debug("rendezvous store listening on %s:%d", bind_address or "*", port)
    return port


def close_store() -> None:
    """Drop this engine's rendezvous store and listening socket, if any."""
    _STATE.store = None
    if _STATE.listen_socket is not None:
        _STATE.listen_socket.close()
        _STATE.listen_socket = None


def join_group(spec: JoinSpec) -> dict[str, Any]:
    """Become rank ``spec.rank`` of a new default process group (:class:`JoinSpec` says how);
    return its record.

    The record says, under ``recorder_note``, why the flight recorder does not record
    this group's collectives (``None`` when it does), under ``socket_ifnames`` which
    interface each of :data:`SOCKET_IFNAME_VARS` names on this rank (set here or before),
    and under ``visible_devices`` the ``CUDA_VISIBLE_DEVICES`` set here (``None``: none).
    """
    import torch
    import torch.distributed as dist

    rank = spec.rank
    world_size = spec.world_size
    os.environ.update({str(k): str(v) for k, v in spec.env.items()})
    store_file = spec.store_file
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(spec.local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(spec.local_world_size),
        MASTER_ADDR=str(spec.master_addr),
    )
    if store_file is None:
        os.environ["MASTER_PORT"] = str(spec.master_port)
    else:
        os.environ.pop("MASTER_PORT", None)
    root = os.environ.get(SNAPSHOT_ROOT_ENV)
    if root:  # made by this host's engine forker, else here (SLURM, MPI, connected engines)
        _private_files.make_private_folder(root, exist_ok=True)
    device = torch.device(spec.device)
    visible_devices = None
    if device.type == "cuda" and spec.cuda_devices is not None:
        visible_devices = narrow_visible_devices(list(spec.cuda_devices))
    socket_ifnames = bind_collective_sockets(spec.socket_address, cuda=device.type == "cuda")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if device.index is None or device.index >= visible:
            raise ValueError(
                f"device {device} is not present on {socket.gethostname()}: "
                f"{visible} CUDA device(s) visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        # Pin before anything else can create a context on the wrong device.
        torch.cuda.set_device(device)
    faulthandler.enable(file=sys.__stderr__, all_threads=True)  # crash reports in the log
    if device.type == "cpu":
        share_cores(spec.local_world_size)
    _torch_recorder.configure(spec.flight_recorder)
    if spec.check_collectives:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        # torch read the variable when it was imported; the group reads the level.
        dist.set_debug_level_from_env()
    if spec.title:
        set_title(spec.title)

    if dist.is_initialized():
        dist.destroy_process_group()
    began = time.monotonic()
    log.debug(
        "rank %d of %d joining a %s group on %s:%s (device %s)",
        rank,
        world_size,
        spec.backend,
        spec.master_addr,
        spec.master_port,
        device,
    )
    timeout = timedelta(seconds=float(spec.pg_timeout_s))
    if rank == 0:
        store = _STATE.store
        if store is None:
            raise RuntimeError("rank 0 has no rendezvous store: open_store() must run first")
    elif store_file is not None:
        store = dist.FileStore(str(store_file), world_size)
        store.set_timeout(timeout)
    else:
        store = dist.TCPStore(
            str(spec.master_addr),
            int(spec.master_port),
            world_size,
            is_master=False,
            timeout=timeout,
        )
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    # Readiness handshake: count in, the last rank to arrive releases everyone.
    if store.add(_READY_KEY, 1) == world_size:
        store.set(_ALL_READY_KEY, "1")
    store.wait([_ALL_READY_KEY])
    check = torch.ones(1, device=device)
    dist.all_reduce(check)
    if int(check.item()) != world_size:
        raise RuntimeError(f"all_reduce check gave {check.item()}, expected {world_size}")
    recorder_note = _torch_recorder.check(spec.backend)
    log.debug("rank %d joined in %.2fs; all_reduce check passed", rank, time.monotonic() - began)
    if recorder_note:
        log.debug("collective trace unavailable: %s", recorder_note)

    _STATE.store = store
    _STATE.rank = rank
    _STATE.world_size = world_size
    _STATE.local_rank = spec.local_rank
    _STATE.device = str(device)
    return {
        "rank": rank,
        "local_rank": spec.local_rank,
        "world_size": world_size,
        "pid": os.getpid(),
        "device": str(device),
        "backend": dist.get_backend(),
        "thread_id": threading.get_ident(),
        "recorder_note": recorder_note,
        "socket_ifnames": socket_ifnames,
        "visible_devices": visible_devices,
    }


def share_cores(local_world_size: int) -> int:
    """A CPU rank's intra-op threads: this host's cores shared among its ranks (at least
    one each), as torchrun's ``OMP_NUM_THREADS=1`` does for one core per rank; torch's
    default, every core in every rank, oversubscribes the host (two ranks on two cores
    run four compute threads). ``OMP_NUM_THREADS`` in the environment is left to rule.
    Returns the thread count."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    log.debug("intra-op threads: %d (%s cores, %d ranks here)", threads, cores, local_world_size)
    return threads


def narrow_visible_devices(indices: list[int]) -> str:
    """Show this process only the CUDA devices ``indices`` (as it saw them under the
    ``CUDA_VISIBLE_DEVICES`` it inherited), in that order; the new value is returned.

    With ``[1, 3]`` the process sees devices 1 and 3 as ``cuda:0`` and ``cuda:1``. The
    inherited value may list indices, UUIDs or MIG names: its entries are picked by
    position. Must run before CUDA initialises in this process (CUDA reads the variable
    once); the value inherited is remembered, so that a later group on the same engine
    (a connected cluster's restart) picks from it again. Raises ``ValueError`` for an
    index the inherited value does not have, and ``RuntimeError`` when CUDA already runs
    here under another value.
    """
    import torch

    key = "CUDA_VISIBLE_DEVICES"
    if not _STATE.narrowed:
        _STATE.inherited_visible = os.environ.get(key)
    inherited = _STATE.inherited_visible
    entries = None if inherited is None else [e.strip() for e in inherited.split(",") if e.strip()]
    chosen = []
    for index in indices:
        if entries is None:
            chosen.append(str(index))
        elif 0 <= index < len(entries):
            chosen.append(entries[index])
        else:
            raise ValueError(
                f"device {index} is not present on {socket.gethostname()}: "
                f"{key}={inherited!r} shows {len(entries)} device(s)"
            )
    value = ",".join(chosen)
    current = os.environ.get(key)
    if torch.cuda.is_initialized() and current != value:
        raise RuntimeError(
            f"CUDA already runs in this engine (pid {os.getpid()}) under {key}={current!r}, "
            f"and the pool needs {value!r}: restart the engines"
        )
    os.environ[key] = value
    _STATE.narrowed = True
    log.debug("%s=%s (devices %s as this engine saw them)", key, value, indices)
    return value


def bind_collective_sockets(address: str | None, *, cuda: bool) -> dict[str, str]:
    """Point gloo (and, for a CUDA rank, NCCL) at the interface that holds ``address``.

    Without ``GLOO_SOCKET_IFNAME`` gloo binds whatever this host's name resolves to,
    which on many hosts is a loopback address (``127.0.1.1``) that peers on other hosts
    cannot reach. Each variable already in this process's environment is left as it is
    (the user's choice, or a launcher's); ``address`` ``None`` (a single-host pool, whose
    names come with ``JoinSpec.env``) changes nothing. A loopback ``address``, or one no
    interface holds, changes nothing either and logs a warning: pinning would only
    hide the problem behind a later connection timeout.

    Returns ``{variable: interface}`` for every one of :data:`SOCKET_IFNAME_VARS` that is
    set afterwards.
    """
    wanted = SOCKET_IFNAME_VARS if cuda else SOCKET_IFNAME_VARS[:1]
    unset = [var for var in wanted if var not in os.environ]
    if address is not None:
        for var in wanted:
            if var not in unset:
                log.info("%s=%s kept from the environment", var, os.environ[var])
    if address is not None and unset:
        interface = _hosts.interface_holding(address)
        if interface is None or _hosts.is_loopback(address):
            log.warning(
                "%s: this rank's address %s is %s; %s left unset, so ranks on other hosts "
                "may not reach it (set them in the engines' environment to choose)",
                socket.gethostname(),
                address,
                "on no interface here" if interface is None else "a loopback address",
                "/".join(unset),
            )
        else:
            for var in unset:
                os.environ[var] = interface
                log.info("%s=%s (the interface that holds %s)", var, interface, address)
    return {var: os.environ[var] for var in SOCKET_IFNAME_VARS if var in os.environ}


def leave_group() -> None:
    """Destroy this rank's default process group and store (no-op if there is none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    close_store()


def rank_context() -> tuple[int, int, int, str]:
    """``(rank, world_size, local_rank, device)`` of this engine after :func:`join_group`."""
    return _STATE.rank, _STATE.world_size, _STATE.local_rank, _STATE.device


def rendezvous_store() -> Any:
    """The group's rendezvous store (a ``FileStore`` on one host; a ``TCPStore`` across
    hosts: server on rank 0, client elsewhere), or None."""
    return _STATE.store
