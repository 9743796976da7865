"""A persistent group of real gloo ranks for tests.

``RankGroup(world_size)`` spawns ``world_size`` processes once, each of which joins a
``torch.distributed`` gloo process group and then waits for work.  ``group.run(fn, *args)``
sends the same picklable function (defined at module level in a test module) to every
rank, runs it concurrently and returns the per-rank return values in rank order.

Contract:

* ``fn`` is called as ``fn(*args, **kwargs)`` on every rank, inside the live process
  group; ``torch.distributed.get_rank()`` tells it which rank it is.  Return values must
  be picklable; prefer plain Python data or small CPU tensors (``.detach().clone()``).
* If any rank raises, ``run`` raises :class:`RankFailure` carrying every rank's traceback.
  Ranks that are left blocked in a collective by a failing peer are given a short grace
  period; after it the whole group is torn down and started again on the next ``run``.
* If the ranks do not answer within ``timeout`` seconds, the group is torn down and
  ``TimeoutError`` is raised.
* ``close()`` stops exactly the processes this group started (by their handles).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_GRACE_AFTER_FAILURE_S = 10.0


class RankFailure(RuntimeError):
    """One or more ranks raised; ``tracebacks`` maps rank -> formatted traceback."""

    def __init__(self, tracebacks: dict[int, str]):
        self.tracebacks = tracebacks
        first = min(tracebacks)
        others = sorted(set(tracebacks) - {first})
        super().__init__(
            f"rank(s) {sorted(tracebacks)} failed; rank {first}:\n{tracebacks[first]}"
            + (f"\n(other failing ranks: {others})" if others else "")
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=90),
    )
    outbox.put((rank, "ready", None))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))
        else:
            try:
                # Plain pickle bytes: a tensor put on the queue as it is travels as a shared
                # memory file whose descriptor the test process keeps (thousands over a run).
                outbox.put((rank, "ok", pickle.dumps(result)))
            except Exception:
                outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankGroup:
    """``world_size`` gloo ranks in spawned processes, reused across many ``run`` calls."""

    def __init__(self, world_size: int, timeout: float = 300.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[mp.Process] = []
        self._inboxes: list[mp.Queue] = []
        self._outbox: mp.Queue | None = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> RankGroup:
        if self.alive:
            return self
        self.close()
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self._inboxes[rank], self._outbox),
                name=f"test-rank-{rank}",
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        ready = self._collect(timeout=120.0, what="process-group start")
        failed = {r: v for r, (status, v) in ready.items() if status != "ready"}
        if failed:
            self.close()
            raise RankFailure(failed)
        return self

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; per-rank results in rank order."""
        self.start()
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        replies = self._collect(timeout=self.timeout, what=getattr(fn, "__name__", "job"))
        errors = {r: v for r, (status, v) in replies.items() if status == "error"}
        if errors:
            raise RankFailure(errors)
        return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

    def _collect(self, timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        assert self._outbox is not None
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            try:
                rank, status, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(replies))
                dead = [r for r in missing if not self._procs[r].is_alive()]
                if dead:
                    self.close()
                    raise RuntimeError(f"{what}: rank process(es) {dead} died") from None
                if time.monotonic() < deadline:
                    continue
                errors = {r: v for r, (s, v) in replies.items() if s == "error"}
                self.close()
                if errors:
                    # Peers of a failing rank are stuck in a collective: report the failure.
                    for r in missing:
                        errors[r] = "(blocked: no reply after a peer failed; group restarted)"
                    return {r: ("error", v) for r, v in errors.items()}
                raise TimeoutError(
                    f"{what}: ranks {missing} gave no answer within {timeout:.0f}s; "
                    "the rank group was stopped and will restart on next use"
                ) from None
            replies[rank] = (status, value)
            if status == "error":
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        return replies

    def close(self) -> None:
        """Stop the processes this group started: politely, then by handle."""
        for inbox, proc in zip(self._inboxes, self._procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self._procs = []
        self._inboxes = []
        self._outbox = None

    def __enter__(self) -> RankGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
