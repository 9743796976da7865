"""Saving the training state with DCP: every rank writes its own shards in parallel.

Sequence of one save (sync or async), on every rank of the group:

1. rank 0 checks the target path and picks a temporary folder name
   (``.<name>.partial-<token>`` next to it); all ranks share the verdict;
2. the model (and optimizer) state is taken as sharded DTensors keyed by clean FQNs;
3. DCP writes ``__<rank>_*.distcp`` per rank and rank 0 writes ``.metadata``;
4. each rank hashes its own files, rank 0 writes ``extra.json`` and ``manifest.json``,
   renames the folder to its final name, applies ``keep_last`` rotation;
5. every rank returns the same :class:`SaveResult` (or raises the same error).

A crash anywhere before step 4's rename leaves only the dot-named temporary folder: the
previous checkpoint is untouched and :func:`list_checkpoints` does not list the partial
one (the next save into the same folder deletes it).

Async saves run steps 3-4 in a background thread after DCP has staged (copied) the state
to CPU memory, over a dedicated gloo group so the training's collectives on the default
group are never interleaved with the checkpoint's. Only one save per process runs at a
time: a new save first waits for the running one (``if_busy="wait"``) or raises
:class:`CheckpointBusyError` (``if_busy="error"``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_interactive._background_groups import background_gloo_group
from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _layout, _manifest
from fsdp_interactive.checkpoint._collective import single_process_quietly
from fsdp_interactive.checkpoint._manifest import CheckpointRecord, Manifest
from fsdp_interactive.checkpoint._safe_reader import METADATA_FILE
from fsdp_interactive.checkpoint.errors import (
    CheckpointBusyError,
    CheckpointError,
    CheckpointPathError,
)
from fsdp_interactive.fsdp import _fqn_state

IfBusy = Literal["wait", "error"]


@dataclass(frozen=True)
class SaveResult:
    """What a finished save reports (identical on every rank)."""

    path: str
    step: int | None
    world_size: int
    size_bytes: int
    seconds: float
    removed_by_rotation: list[str] = field(default_factory=list)
    record: CheckpointRecord | None = None


class SaveHandle:
    """A running asynchronous save. ``wait()`` returns its :class:`SaveResult`.

    The checkpoint is published by the background thread whether or not ``wait`` is
    called; ``wait`` re-raises the save's error, if any.
    """

    def __init__(self, path: Path):
        self.path = str(path)
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the save has finished (published or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until published; raise its error, or ``TimeoutError`` after ``timeout``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint save to {self.path} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self) -> BaseException | None:
        """The save's error once done (``None`` while running or on success)."""
        return self._error if self._done.is_set() else None

    def _finish(self, result: SaveResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return f"SaveHandle({self.path!r}, {state})"


_inflight_lock = threading.Lock()
_inflight: SaveHandle | None = None


def _wait_for_inflight(if_busy: IfBusy, ranks: Ranks) -> None:
    """Wait for (or, with ``if_busy="error"``, refuse because of) a running async save.

    With ``"error"`` the ranks agree first, so either all of them refuse or none does.
    """
    if if_busy not in ("wait", "error"):
        raise ValueError(f"if_busy must be 'wait' or 'error', got {if_busy!r}")
    with _inflight_lock:
        running = _inflight
    busy = running is not None and not running.done()
    if if_busy == "error":
        busy_ranks = [r for r, b in enumerate(ranks.all_gather(busy)) if b]
        if busy_ranks:
            where = running.path if running is not None else "another checkpoint"
            raise CheckpointBusyError(
                f"a checkpoint save ({where}) is still running on rank(s) {busy_ranks}; "
                "wait for its handle or pass if_busy='wait'"
            )
        return
    if running is not None:
        running._done.wait()


def _resolve_step(step: int | None, extra: Mapping[str, Any] | None) -> int | None:
    if step is None and extra is not None and isinstance(extra.get("step"), int):
        step = extra["step"]
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    return step


def _prepare(
    path: str | os.PathLike,
    keep_last: int | None,
    overwrite: bool,
    extra: Mapping[str, Any] | None,
    step: int | None,
    ranks: Ranks,
) -> tuple[Path, Path, str, int | None]:
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    extra_json = _manifest.encode_extra(extra)
    step = _resolve_step(step, extra)
    final = Path(path).absolute()

    def preflight() -> str:
        _layout.check_save_target(final, overwrite)
        _layout.remove_stale_partials(final.parent)
        token = _layout.new_token()
        try:
            _layout.partial_path(final, token).mkdir()
        except PermissionError as exc:
            raise CheckpointPathError(f"folder {str(final.parent)!r} is not writable") from exc
        return token

    token = ranks.run_on_rank0(preflight)
    return final, _layout.partial_path(final, token), extra_json, step


def _capture(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    state: dict[str, Any] = {"model": _fqn_state.model_state(model)}
    if optimizer is not None:
        state["optim"] = _fqn_state.optimizer_state(model, optimizer)
    return state


def _finalize(
    ranks: Ranks,
    partial: Path,
    final: Path,
    extra_json: str,
    step: int | None,
    has_optimizer: bool,
    keep_last: int | None,
    started: float,
) -> SaveResult:
    own = sorted(p for p in partial.glob(f"__{ranks.rank}_*") if p.is_file())
    try:
        own_records = {p.name: _manifest.hash_file(p) for p in own}
        error = None
    except OSError as exc:
        own_records, error = {}, CheckpointError(f"could not read back {partial}: {exc}")
    gathered = ranks.all_gather((own_records, error))
    for _, err in gathered:
        if err is not None:
            raise err

    def publish() -> SaveResult:
        files: dict[str, _manifest.FileRecord] = {}
        for records, _ in gathered:
            files.update(records)
        files[METADATA_FILE] = _manifest.hash_file(partial / METADATA_FILE)
        now = time.time()
        manifest = Manifest(
            step=step,
            world_size=ranks.size,
            created_unix=now,
            created_utc=datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
            has_optimizer=has_optimizer,
            files=files,
        )
        _manifest.write_text_durably(partial / _manifest.EXTRA_FILE, extra_json)
        _manifest.write_text_durably(partial / _manifest.MANIFEST_FILE, manifest.to_json())
        _layout.fsync_dir(partial)
        _layout.publish(partial, final)
        removed = _layout.rotate(final.parent, keep_last, protect=final) if keep_last else []
        record = manifest.record(final)
        return SaveResult(
            path=str(final),
            step=step,
            world_size=ranks.size,
            size_bytes=record.size_bytes,
            seconds=time.monotonic() - started,
            removed_by_rotation=removed,
            record=record,
        )

    return ranks.run_on_rank0(publish)


def _copying_stager() -> Any:
    """The stager ``dcp.async_save`` uses when it is given no writer: one copy per tensor.

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


def _write(state: dict[str, Any], partial: Path, ranks: Ranks) -> None:
    try:
        with single_process_quietly():
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True),
                process_group=ranks.group,
                no_dist=not ranks.distributed,
            )
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"writing checkpoint data to {partial} failed: {exc}") from exc


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    overwrite: bool = False,
    if_busy: IfBusy = "wait",
) -> SaveResult:
    """Save ``model`` (and ``optimizer``) to the checkpoint folder ``path``; collective.

    Every rank of the default process group must call this with the same arguments.
    ``extra`` is stored as JSON (``extra["step"]`` is used as ``step`` when ``step`` is
    not given). ``keep_last=N`` deletes all but the newest N checkpoints in ``path``'s
    parent folder after publishing. An existing checkpoint at ``path`` is replaced only
    with ``overwrite=True``. Not saved: RNG states, data-loader positions, LR schedulers
    (put their plain-data state into ``extra``).
    """
    ranks = Ranks()
    _wait_for_inflight(if_busy, ranks)
    started = time.monotonic()
    final, partial, extra_json, step = _prepare(path, keep_last, overwrite, extra, step, ranks)
    state = _capture(model, optimizer)
    _write(state, partial, ranks)
    return _finalize(
        ranks, partial, final, extra_json, step, optimizer is not None, keep_last, started
    )


def async_save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    overwrite: bool = False,
    if_busy: IfBusy = "wait",
) -> SaveHandle:
    """Like :func:`save`, but returns once the state is staged to CPU memory.

    Writing, hashing and publishing continue in a background thread while training goes
    on; the returned :class:`SaveHandle` reports the outcome. Staging copies the state,
    so later in-place updates of the parameters do not leak into the checkpoint. Uses
    ``torch.distributed.checkpoint.async_save`` over a dedicated gloo group.
    """
    global _inflight
    ranks = Ranks()
    _wait_for_inflight(if_busy, ranks)
    started = time.monotonic()
    final, partial, extra_json, step = _prepare(path, keep_last, overwrite, extra, step, ranks)
    state = _capture(model, optimizer)
    group = background_gloo_group("checkpoint")
    side_ranks = Ranks(group)
    handle = SaveHandle(final)
    stager = _copying_stager()
    try:
        upload = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True),
            process_group=group,
            no_dist=not ranks.distributed,
            **({"async_stager": stager} if stager is not None else {}),
        )
    except Exception as exc:
        if stager is not None:
            stager.close()
        raise CheckpointError(f"staging checkpoint {final} failed: {exc}") from exc

    def background() -> None:
        try:
            try:
                upload.result()
            except (Exception, CheckpointException) as exc:
                raise CheckpointError(
                    f"writing checkpoint data to {partial} failed: {exc}"
                ) from exc
            finally:
                if stager is not None:
                    stager.close()
            result = _finalize(
                side_ranks,
                partial,
                final,
                extra_json,
                step,
                optimizer is not None,
                keep_last,
                started,
            )
        except BaseException as exc:
            handle._finish(None, exc)
        else:
            handle._finish(result, None)

    with _inflight_lock:
        _inflight = handle
    threading.Thread(target=background, name=f"checkpoint-save:{final.name}", daemon=True).start()
    return handle


def wait_for_pending_save(timeout: float | None = None) -> SaveResult | None:
    """Wait for this process's running async save, if any; its result (or ``None``)."""
    with _inflight_lock:
        running = _inflight
    return None if running is None else running.wait(timeout)
