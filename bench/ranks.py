"""Run one function on a freshly spawned group of gloo ranks.

``run_on_ranks(world_size, fn, *args)`` starts ``world_size`` fresh processes, each of
which joins a gloo process group on a free local port, runs
``fn(*args)`` and sends its return value back.  The per-rank results come back in rank
order.

Contract:

* ``fn`` must be a module-level function (it is pickled by reference) and must return
  picklable plain data.
* Every rank runs with ``torch.set_num_threads(threads)``; with ``pin_cores``, rank ``r``
  and all its threads run on the ``r``-th usable logical CPU only, where there are at
  least as many CPUs as ranks (ranks then never trade cores or caches: the step-time
  figures' samples vary less); ``env`` is added to each
  rank's environment before its process group forms (torch's debug level is re-read
  from it, as the forkserver imported torch before).
* If a rank raises, :class:`RankError` carries its traceback; if the ranks take longer
  than ``timeout`` seconds, ``TimeoutError``.  In both cases, and on success, exactly the
  processes started here are joined, and killed by their handles if still alive.
* Nothing is reused between calls: each call gets fresh processes (that is the point for
  figures whose ranks must not share state).  They are forked from multiprocessing's
  ``forkserver``, which has imported torch once (and never ran an op, so no thread pool
  is forked), so a group starts in well under a second instead of re-importing torch per
  rank; the server ends with this process.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class RankError(RuntimeError):
    """A rank raised; the message holds the first failing rank's traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    pg_timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    outbox: mp.Queue,
    env: dict[str, str],
    backend: str = "gloo",
    pin_cores: bool = False,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if env:
            dist.set_debug_level_from_env()
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        if pin_cores:
            _pin_to_core(rank, world_size)
        try:
            result = fn(*args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))
    else:
        outbox.put((rank, True, result))


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 600.0,
    threads: int = 1,
    pg_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    pin_cores: bool = False,
) -> list[Any]:
    """Spawn ``world_size`` gloo ranks, run ``fn(*args)`` on each, return results by rank.

    ``backend="nccl"``: rank ``r`` uses CUDA device ``r`` and the group is NCCL's.

    ``pg_timeout`` bounds each collective, so a rank stuck in one fails instead of hanging.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    outbox = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                port,
                threads,
                pg_timeout,
                fn,
                args,
                outbox,
                dict(env or {}),
                backend,
                pin_cores,
            ),
            name=f"bench-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                rank, ok, value = outbox.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                dead = [r for r in missing if not procs[r].is_alive()]
                if dead:
                    # A process can exit right after queueing its reply: look once more.
                    try:
                        rank, ok, value = outbox.get(timeout=2.0)
                    except queue.Empty:
                        raise RankError(
                            f"{_name(fn)}: rank process(es) {dead} died without a reply"
                        ) from None
                elif time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{_name(fn)}: ranks {missing} gave no answer within {timeout:.0f}s"
                    ) from None
                else:
                    continue
            if not ok:
                raise RankError(f"{_name(fn)} failed on rank {rank}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(world_size)]
    finally:
        for proc in procs:
            if proc.pid is not None:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
        outbox.close()


def cores_for_pinning(world_size: int) -> list[int] | None:
    """The logical CPUs ranks ``0..world_size-1`` are pinned to, or ``None`` if too few."""
    usable = sorted(os.sched_getaffinity(0))
    return usable[:world_size] if world_size <= len(usable) else None


def _pin_to_core(rank: int, world_size: int) -> None:
    """Pin every thread of this process (gloo's, started with the group, included)."""
    cores = cores_for_pinning(world_size)
    if cores is None:
        return
    for task in os.listdir("/proc/self/task"):
        # A thread that ended since the listing has nothing left to pin.
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), {cores[rank]})


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "bench.models"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))
