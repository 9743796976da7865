"""The one save pipeline: capture -> plan -> write -> finalize, in either of two modes.

On every rank of the group:

1. **capture**: the model (and optimizer) state as sharded DTensors keyed by clean FQNs,
   plus the packed states of the Stateful objects (no copy of the model's data);
2. **plan**: rank 0 checks the target path, removes leftovers of crashed saves next to
   it and creates the temporary folder ``.<name>.partial-<token>``; all ranks share the
   verdict;
3. **write**: DCP writes ``__<rank>_*.distcp`` per rank and rank 0 writes ``.metadata``;
4. **finalize**: each rank hashes its own files; rank 0 writes ``extra.json`` and
   ``manifest.json``, renames the folder to its final name (publish) and applies
   ``keep_last`` rotation; every rank gets the same :class:`SaveResult`.

``mode="sync"`` runs all four in the calling thread. ``mode="async"`` runs 1-2 and DCP's
staging (a copy of the state into CPU memory) in the calling thread, and the rest of 3
and 4 in a background thread over a gloo group of its own, so the training's
collectives on the default group are never interleaved with the checkpoint's. State on
CUDA is staged into pinned buffers kept for the next save, CPU state into pageable
copies freed after the save (:func:`stager_for`).

Arguments are checked and the state captured before anything is created on disk, so
bad input leaves nothing behind. A failure or crash after planning leaves the dot-named
temporary folder, which is never listed and which the next save into the same folder
removes; the previous checkpoint is untouched.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fsdp_interactive._background_groups import background_gloo_group
from fsdp_interactive._ranks import Ranks
from fsdp_interactive._torch_compat import ShardedTensor, local_tensor
from fsdp_interactive.checkpoint import _checkpoint_folders, _model_state, _stateful
from fsdp_interactive.checkpoint._format import _manifest, _owner_seal
from fsdp_interactive.checkpoint._format._safe_reader import METADATA_FILE
from fsdp_interactive.checkpoint._save_handle import INFLIGHT, SaveHandle, SaveResult
from fsdp_interactive.checkpoint._single_process import single_process_quietly
from fsdp_interactive.checkpoint.errors import CheckpointError, CheckpointPathError
from fsdp_interactive.fsdp import _fqn_state

logger = logging.getLogger(__name__)

Mode = Literal["sync", "async"]


@dataclass(frozen=True)
class SaveRequest:
    """What the caller asked for, validated (the same on every rank)."""

    final: Path
    step: int | None
    keep_last: int | None
    overwrite: bool
    extra_json: str
    #: The checkpoint folder's mode (its files: ``mode & 0o666``).
    mode: int = _checkpoint_folders.DEFAULT_MODE

    @classmethod
    def of(
        cls,
        path: Any,
        *,
        step: int | None,
        keep_last: int | None,
        overwrite: bool,
        extra: Mapping[str, Any] | None,
        mode: int = _checkpoint_folders.DEFAULT_MODE,
    ) -> SaveRequest:
        """Validate the arguments of a save; ``TypeError``/``ValueError`` naming the bad one."""
        if keep_last is not None and (
            not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
        ):
            raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
        extra_json = _manifest.encode_extra(extra)
        if step is None and extra is not None and isinstance(extra.get("step"), int):
            step = extra["step"]
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be a non-negative int or None, got {step!r}")
        mode = _checkpoint_folders.check_mode(mode)
        return cls(Path(path).absolute(), step, keep_last, bool(overwrite), extra_json, mode)


@dataclass(frozen=True)
class Contents:
    """What the manifest says a checkpoint holds besides the model."""

    has_optimizer: bool
    stateful: dict[str, str] = field(default_factory=dict)


def local_pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors this rank stores of a state-dict value: a DTensor's local shard, a
    ``ShardedTensor``'s local shards (torch FSDP1's sharded state), else the tensor."""
    if isinstance(tensor, DTensor):
        return [local_tensor(tensor)]
    if isinstance(tensor, ShardedTensor):
        return [shard.tensor for shard in tensor.local_shards()]
    return [tensor]


@dataclass(frozen=True)
class Capture:
    """The state one rank hands to DCP (keyed "model", "optim", "stateful", ...)."""

    state: dict[str, Any]
    contents: Contents

    def local_bytes(self) -> int:
        """Bytes of this rank's share of the tensors (its shards of DTensors)."""
        total = 0

        def add(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            for local in local_pieces(t):
                total += local.numel() * local.element_size()
            return t

        _fqn_state.map_tensors(self.state, add)
        return total


@dataclass(frozen=True)
class SavePlan:
    """One planned save: where it writes and publishes, in which mode."""

    request: SaveRequest
    partial: Path
    mode: Mode
    started: float

    @property
    def final(self) -> Path:
        return self.request.final


def capture(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: Mapping[str, _stateful.Stateful],
    ranks: Ranks,
) -> Capture:
    """Stage 1: the sharded model/optimizer state and the packed Stateful states."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    state: dict[str, Any] = {"model": _model_state.model_state(model)}
    if optimizer is not None:
        state["optim"] = _model_state.optimizer_state(model, optimizer)
    sections, kinds = _stateful.capture(stateful, ranks)
    state.update(sections)
    captured = Capture(state, Contents(has_optimizer=optimizer is not None, stateful=kinds))
    logger.info(
        "rank %d captured %s (%d bytes on this rank)",
        ranks.rank,
        ", ".join(state),
        captured.local_bytes(),
    )
    return captured


def plan(request: SaveRequest, mode: Mode, ranks: Ranks, *, started: float) -> SavePlan:
    """Stage 2: rank 0 checks the target and creates the temporary folder.

    ``started`` (``time.monotonic()``) is when the save began, for its reported duration.
    """
    final = request.final

    def preflight() -> str:
        _checkpoint_folders.check_save_target(final, request.overwrite, request.mode)
        _checkpoint_folders.remove_stale_partials(final.parent)
        token = _checkpoint_folders.new_token()
        try:
            _checkpoint_folders.make_partial(final, token)
        except PermissionError as exc:
            raise CheckpointPathError(f"folder {str(final.parent)!r} is not writable") from exc
        return token

    partial = _checkpoint_folders.partial_path(final, ranks.run_on_rank0(preflight))
    _check_shared(partial, ranks)
    logger.info("save %s (%s, %d ranks): writing to %s", final, mode, ranks.size, partial)
    return SavePlan(request, partial, mode, started)


def _check_shared(partial: Path, ranks: Ranks) -> None:
    """Every rank must see the folder rank 0 just created: ranks on several hosts write
    into one checkpoint, so its folder must be on a file system they share. Otherwise
    rank 0 removes the (empty) folder and every rank raises the same
    :class:`CheckpointPathError`, before anything is written."""

    seen = ranks.all_gather((partial.is_dir(), socket.gethostname()))
    blind = {rank: host for rank, (sees, host) in enumerate(seen) if not sees}
    if not blind:
        return
    if ranks.rank == 0:
        with contextlib.suppress(OSError):
            partial.rmdir()
    where = ", ".join(f"rank {rank} on {host}" for rank, host in sorted(blind.items()))
    raise CheckpointPathError(
        f"folder {str(partial.parent)!r} is not shared by all ranks: {where} do not see the "
        f"folder rank 0 created on {seen[0][1]}; save to a directory every host mounts "
        "(a shared file system), nothing was written"
    )


def run(plan: SavePlan, captured: Capture, ranks: Ranks) -> SaveHandle:
    """Stages 3 and 4 in ``plan.mode``; the returned handle is done already in sync mode."""
    handle = SaveHandle(str(plan.final))
    contents = captured.contents
    if plan.mode == "sync":
        _write(captured.state, plan, ranks)
        handle.set_result(_finalize(plan, contents, ranks))
        return handle
    side = Ranks(background_gloo_group("checkpoint")) if ranks.distributed else ranks
    upload = _stage(captured.state, plan, side)

    def background() -> SaveResult:
        _await_upload(upload, plan, side)
        return _finalize(plan, contents, side)

    def failed(exc: BaseException) -> None:
        logger.info("async save %s failed: %s", plan.final, exc)

    INFLIGHT.hold(handle)
    handle.run_in_thread(background, f"checkpoint-save:{plan.final.name}", failed)
    return handle


def _writer(plan: SavePlan) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(str(plan.partial), sync_files=True)


def _write(state: dict[str, Any], plan: SavePlan, ranks: Ranks) -> None:
    started = time.monotonic()
    try:
        with single_process_quietly():
            dcp.save(
                state,
                storage_writer=_writer(plan),
                process_group=ranks.group,
                no_dist=not ranks.distributed,
            )
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"writing checkpoint data to {plan.partial} failed: {exc}") from exc
    logger.info("rank %d wrote its shards in %.3fs", ranks.rank, time.monotonic() - started)


def _copying_stager() -> Any:
    """The stager ``dcp.async_save`` uses when it is given no writer: one copy per tensor,
    into pageable memory allocated for this save.

    Given a ``FileSystemWriter``, ``async_save`` stages through the writer instead, which
    deep-copies every CPU DTensor and then copies it once more (about three times the
    blocking time on CPU ranks). ``None`` where this torch has no ``DefaultStager``.
    """
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # pragma: no cover - torch without the default stager
        return None
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


_PINNED_STAGER: Any = None


def _pinned_stager() -> Any:
    """This process's stager for state held on CUDA: pinned CPU buffers, kept and reused by
    every later save (what DCP's own default staging does: ``DefaultStager`` with
    ``use_pinned_memory`` caches one pinned copy per source storage,
    ``torch/distributed/checkpoint/_state_dict_stager.py``), filled with non-blocking copies.

    Reuse is safe because one save per process runs at a time (a new save waits until the
    previous one has written everything it staged). A buffer lives as long as the tensor
    storage it copies (the cache holds its sources weakly).
    """
    global _PINNED_STAGER
    if _PINNED_STAGER is None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        _PINNED_STAGER = DefaultStager(
            StagingOptions(
                use_pinned_memory=True,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=True,
            )
        )
    return _PINNED_STAGER


def holds_cuda_tensors(state: Any) -> bool:
    """Whether any tensor in ``state`` (a DTensor by its local shard) is on a CUDA device."""
    found = False

    def look(t: torch.Tensor) -> torch.Tensor:
        nonlocal found
        found = found or any(piece.device.type == "cuda" for piece in local_pieces(t))
        return t

    _fqn_state.map_tensors(state, look)
    return found


def stager_for(state: dict[str, Any]) -> tuple[Any, bool]:
    """(stager, kept): the pinned, reused stager when ``state`` holds CUDA tensors (pinned
    host memory makes the device-to-host copies fast, and pinning is paid once), else a
    fresh pageable one for this save only (pinning CPU-resident state would copy as much
    and create a CUDA context on CPU ranks). ``kept``: the stager outlives the save."""
    if holds_cuda_tensors(state):
        try:
            return _pinned_stager(), True
        except ImportError:  # pragma: no cover - torch without the default stager
            return None, False
    return _copying_stager(), False


@dataclass
class _Upload:
    future: Future
    stager: Any
    kept: bool
    started: float

    def release(self) -> None:
        """Free a stager made for this save only (a kept one keeps its buffers)."""
        if self.stager is not None and not self.kept:
            self.stager.close()


def _stage(state: dict[str, Any], plan: SavePlan, side: Ranks) -> _Upload:
    started = time.monotonic()
    stager, kept = stager_for(state)
    try:
        with single_process_quietly():
            future = dcp.async_save(
                state,
                storage_writer=_writer(plan),
                process_group=side.group,
                no_dist=not side.distributed,
                **({"async_stager": stager} if stager is not None else {}),
            )
    except Exception as exc:
        if stager is not None and not kept:
            stager.close()
        raise CheckpointError(f"staging checkpoint {plan.final} failed: {exc}") from exc
    logger.info(
        "rank %d staged its shards in %.3fs (%s); writing continues in the background",
        side.rank,
        time.monotonic() - started,
        "pinned, reused buffers" if kept else "pageable copies",
    )
    return _Upload(future, stager, kept, time.monotonic())


def _await_upload(upload: _Upload, plan: SavePlan, side: Ranks) -> None:
    try:
        upload.future.result()
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"writing checkpoint data to {plan.partial} failed: {exc}") from exc
    finally:
        upload.release()
    logger.info(
        "rank %d wrote its shards in %.3fs (background)",
        side.rank,
        time.monotonic() - upload.started,
    )


def _finalize(plan: SavePlan, contents: Contents, ranks: Ranks) -> SaveResult:
    """Stage 4: hash, manifest, publish, rotate. Collective over ``ranks``."""
    partial, final, request = plan.partial, plan.final, plan.request
    started = time.monotonic()
    own = sorted(p for p in partial.glob(f"__{ranks.rank}_*") if p.is_file())
    try:
        own_records = {p.name: _manifest.hash_file(p) for p in own}
        error = None
    except OSError as exc:
        own_records, error = {}, CheckpointError(f"could not read back {partial}: {exc}")
    logger.debug(
        "rank %d hashed %d files (%d bytes) in %.3fs",
        ranks.rank,
        len(own_records),
        sum(r.size for r in own_records.values()),
        time.monotonic() - started,
    )
    gathered = ranks.all_gather((own_records, error))
    for _, err in gathered:
        if err is not None:
            raise err

    def publish() -> SaveResult:
        files: dict[str, _manifest.FileRecord] = {}
        for records, _ in gathered:
            files.update(records)
        files[METADATA_FILE] = _manifest.hash_file(partial / METADATA_FILE)
        manifest = _manifest.Manifest.now(
            step=request.step,
            world_size=ranks.size,
            has_optimizer=contents.has_optimizer,
            files=files,
            stateful=contents.stateful,
        )
        manifest_json = manifest.to_json()
        _manifest.write_text_durably(partial / _manifest.EXTRA_FILE, request.extra_json)
        _manifest.write_text_durably(partial / _manifest.MANIFEST_FILE, manifest_json)
        _owner_seal.write_seal(partial, manifest_json, request.extra_json)
        _checkpoint_folders.fsync_dir(partial)
        record = manifest.record(final)
        logger.info(
            "manifest of %s: %d files, %d bytes", final, record.num_files, record.size_bytes
        )
        _checkpoint_folders.publish(partial, final, mode=request.mode)
        keep_last = request.keep_last
        removed = (
            _checkpoint_folders.rotate(final.parent, keep_last, protect=final) if keep_last else []
        )
        return SaveResult(
            path=str(final),
            step=request.step,
            world_size=ranks.size,
            size_bytes=record.size_bytes,
            seconds=time.monotonic() - plan.started,
            removed_by_rotation=removed,
            record=record,
        )

    result = ranks.run_on_rank0(publish)
    logger.info("save %s finished in %.3fs", final, result.seconds)
    return result
