"""``save`` and ``async_save``: the save pipeline (:mod:`._pipeline`) in its two modes.

Every rank of the default process group calls them with the same arguments. Only one
save per process runs at a time: a new save first waits for the running asynchronous
one (``if_busy="wait"``) or raises :class:`CheckpointBusyError` on every rank
(``if_busy="error"``). It also waits for a background snapshot of this process still
being written (a snapshot likewise waits for a running asynchronous save).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _pipeline
from fsdp_interactive.checkpoint._fsdp1_quietly import quietly
from fsdp_interactive.checkpoint._save_handle import INFLIGHT, IfBusy, SaveHandle, SaveResult
from fsdp_interactive.checkpoint._snapshot._snapshot_handle import INFLIGHT as SNAPSHOTS
from fsdp_interactive.checkpoint._stateful import Stateful, check_stateful


@quietly
def _start(
    request: _pipeline.SaveRequest,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    mode: _pipeline.Mode,
    stateful: Mapping[str, Stateful] | None,
    if_busy: IfBusy,
) -> SaveHandle:
    started = time.monotonic()
    objects = check_stateful(stateful)
    ranks = Ranks()
    SNAPSHOTS.wait()  # a background snapshot may stage through the buffers this save uses
    INFLIGHT.make_room(if_busy, ranks)
    captured = _pipeline.capture(model, optimizer, objects, ranks)
    plan = _pipeline.plan(request, mode, ranks, started=started)
    return _pipeline.run(plan, captured, ranks)


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    stateful: Mapping[str, Stateful] | None = None,
    step: int | None = None,
    keep_last: int | None = None,
    overwrite: bool = False,
    if_busy: IfBusy = "wait",
    mode: int = 0o700,
) -> SaveResult:
    """Save ``model`` (and ``optimizer``) to the checkpoint folder ``path``; collective.

    ``extra`` is stored as JSON (``extra["step"]`` is used as ``step`` when ``step`` is
    not given). ``stateful`` maps names to objects with ``state_dict()`` /
    ``load_state_dict()`` (LR schedulers, :class:`RNGState`,
    :class:`ResumableDistributedSampler`): a global one is saved once and must be the same
    on every rank, a :class:`PerRankStateful` is saved per rank (see :func:`load` for
    resharding). ``keep_last=N`` deletes all but the newest N checkpoints in ``path``'s
    parent folder after publishing. An existing checkpoint at ``path`` is replaced only
    with ``overwrite=True``. The checkpoint appears under ``path`` (one rename) only once
    complete; every rank returns the same :class:`SaveResult` or raises the same error.

    Private by default, whatever the umask: the checkpoint's folder (and each folder the
    save makes above it) gets ``mode`` (0o700: only you), its files ``mode & 0o666``
    (0o600); ``mode=0o750`` lets your group read it. Its manifest is sealed with your
    checkpoint key (docs/security.md), so that :func:`load` refuses a checkpoint someone
    else put in its place. A ``path`` where another user could do that, below a folder
    another user owns or can write without the sticky bit, is refused
    (:class:`CheckpointPathError` naming the folder and what to do).
    """
    request = _pipeline.SaveRequest.of(
        path, step=step, keep_last=keep_last, overwrite=overwrite, extra=extra, mode=mode
    )
    return _start(request, model, optimizer, mode="sync", stateful=stateful, if_busy=if_busy).wait()


def async_save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    stateful: Mapping[str, Stateful] | None = None,
    step: int | None = None,
    keep_last: int | None = None,
    overwrite: bool = False,
    if_busy: IfBusy = "wait",
    mode: int = 0o700,
) -> SaveHandle:
    """Like :func:`save`, but returns once the state is staged to CPU memory.

    Writing, hashing and publishing continue in a background thread while training goes
    on; the returned :class:`SaveHandle` reports the outcome. Staging copies the state
    (Stateful states are copied when captured), so later in-place updates of the
    parameters, the optimizer or a scheduler do not leak into the checkpoint. Uses
    ``torch.distributed.checkpoint.async_save`` over a dedicated gloo group. ``mode``
    and what is refused: as for :func:`save`.
    """
    request = _pipeline.SaveRequest.of(
        path, step=step, keep_last=keep_last, overwrite=overwrite, extra=extra, mode=mode
    )
    return _start(request, model, optimizer, mode="async", stateful=stateful, if_busy=if_busy)


def wait_for_pending_save(timeout: float | None = None) -> SaveResult | None:
    """Wait for this process's latest async save; its result (raising its error), or
    ``None`` if this process has started none."""
    latest = INFLIGHT.latest()
    return None if latest is None else latest.wait(timeout)
