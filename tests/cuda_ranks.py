"""Spawned ranks for the CUDA tests: one process per GPU in an NCCL group.

``run_ranks(fn, world)`` starts ``world`` processes (spawned: the test process may hold a
CUDA context already), each pinned to ``cuda:<rank>`` and joined to an NCCL group, calls
``fn(*args)`` (a module-level function) in each, and returns the per-rank results in rank
order; a rank that raises fails the call with its traceback. Processes that do not
answer within ``timeout`` seconds are ended (by their handles) and the call fails.

``backend="gloo"`` starts CPU ranks instead (no device is set): a CPU rank on a GPU host,
and a dry run of a CUDA test's plumbing on a machine without a GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world: int,
    port: int,
    backend: str,
    results: mp.Queue,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        results.put((rank, "ok", fn(*args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: str = "nccl",
    timeout: float = 300.0,
) -> list[Any]:
    """Per-rank results of ``fn(*args)`` on ``world`` fresh ranks (see the module docstring)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, args, rank, world, port, backend, results),
            name=f"cuda-test-rank-{rank}",
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    replies: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(replies) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{fn.__name__}: ranks {sorted(set(range(world)) - set(replies))} did not answer in {timeout:.0f}s"
                )
            try:
                rank, status, value = results.get(timeout=min(left, 5.0))
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{fn.__name__}: {dead} exited without an answer") from None
                continue
            replies[rank] = (status, value)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    errors = {r: v for r, (status, v) in replies.items() if status != "ok"}
    if errors:
        first = min(errors)
        raise AssertionError(
            f"{fn.__name__} failed on ranks {sorted(errors)}; rank {first}:\n{errors[first]}"
        )
    return [replies[r][1] for r in range(world)]
