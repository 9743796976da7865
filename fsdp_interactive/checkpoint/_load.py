"""Loading a checkpoint into a (possibly differently sharded) model, optimizer and
Stateful objects.

All-or-nothing: before anything is written into them,

1. the checkpoint is checked to be this user's (:func:`check_folder`): no folder on the
   way to it, and neither it nor a file in it, can be changed by another user, and its
   seal holds under this user's checkpoint key (:mod:`._format._owner_seal`), unless the caller
   says it trusts it (``trusted=True``); then the manifest and DCP metadata are read
   (metadata with the allow-list unpickler, at most the size the manifest gives it);
2. every data file is checked against the manifest's size and SHA-256, the files split
   across the ranks (``verify=False`` checks sizes only);
3. the checkpoint's keys and shapes are compared with the model's (and the optimizer's
   parameter groups, and the Stateful names and kinds);
4. the data are read by DCP into freshly allocated buffers shaped like this rank's
   shards (DCP does the resharding: a checkpoint from N ranks loads on M);
5. per-rank Stateful states are resharded when N != M (``reshard_state``).

Only then are the buffers applied: the Stateful objects' ``load_state_dict`` first (the
one step whose errors cannot be checked beforehand: if one raises, every rank raises it
and the model and optimizer are left as they were), then ``set_model_state_dict`` /
``set_optimizer_state_dict``. Every rank raises the same error when any check fails.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fsdp_interactive import _path_trust
from fsdp_interactive._ranks import Ranks
from fsdp_interactive._text import first_few
from fsdp_interactive._torch_compat import ShardedTensor, set_element
from fsdp_interactive.checkpoint import _model_state, _stateful
from fsdp_interactive.checkpoint._format import _manifest, _owner_seal
from fsdp_interactive.checkpoint._format import _owner_key as _owner_key_module
from fsdp_interactive.checkpoint._format._safe_reader import (
    METADATA_FILE,
    read_metadata,
    safe_load,
    section_paths,
    storage_extents,
)
from fsdp_interactive.checkpoint._fsdp1_quietly import quietly
from fsdp_interactive.checkpoint._in_place import is_own, owned_storages
from fsdp_interactive.checkpoint._save_handle import INFLIGHT
from fsdp_interactive.checkpoint.errors import (
    CheckpointError,
    CheckpointPathError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UntrustedCheckpointError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class LoadReport:
    """What a finished load reports (identical on every rank).

    ``missing_keys`` names what this load asked for and the checkpoint lacks (model keys,
    ``"optim"``, ``"stateful:<name>"``); ``unexpected_keys`` what the checkpoint holds
    for the model or optimizer and the model lacks (``"optim:<fqn>"``).
    """

    path: str
    step: int | None
    saved_world_size: int
    world_size: int
    loaded_optimizer: bool
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    loaded_stateful: list[str] = field(default_factory=list)


def check_folder(
    path: Path, *, trusted: bool = False
) -> tuple[_manifest.Manifest, Metadata, dict[str, Any]]:
    """The manifest, DCP metadata and ``extra`` of the checkpoint folder ``path`` (no data
    read), once it is known to be this user's: :class:`UntrustedCheckpointError` naming
    the folder or file when another user could have changed it or its seal does not hold
    (neither is checked with ``trusted``). Every file is read without following a link or
    waiting on a FIFO, with a bound on its size."""
    if not path.exists():
        raise CheckpointPathError(f"checkpoint path {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointPathError(f"checkpoint path {str(path)!r} is a file; expected a folder")
    if not trusted:
        _refuse_open(path)
    manifest_json = _manifest.read_manifest_text(path)
    extra_json = _manifest.read_json_text(path / _manifest.EXTRA_FILE, "extra data")
    if not trusted:
        seal_json = _manifest.read_json_text(path / _owner_seal.SEAL_FILE, "the seal")
        _owner_seal.check(_owner_key(), path, manifest_json, extra_json, seal_json)
    manifest = _manifest.Manifest.from_json(manifest_json, path / _manifest.MANIFEST_FILE)
    listed = manifest.files.get(METADATA_FILE)
    metadata = read_metadata(path, limit=listed.size if listed is not None else None)
    return manifest, metadata, _manifest.read_extra(path, extra_json)


def _owner_key() -> bytes:
    try:
        return _owner_key_module.owner_key()
    except _owner_key_module.OwnerKeyError as exc:
        raise UntrustedCheckpointError(f"cannot check the checkpoint's seal: {exc}") from None


def open_entry(path: Path) -> tuple[Path, str] | None:
    """What another user could change of the checkpoint folder ``path`` (a folder on the
    way to it, it, or a file in it: see :mod:`fsdp_interactive._path_trust`), with what
    lets them; ``None`` when nothing."""
    found = _path_trust.open_place(path)
    if found is not None:
        return found
    for entry in sorted(path.iterdir()):
        info = entry.lstat()
        if stat.S_ISLNK(info.st_mode):
            continue  # a link is no file of a checkpoint: refused when it is read
        reason = _path_trust.why_file_open(info)
        if reason is not None:
            return entry, reason
    return None


def _refuse_open(path: Path) -> None:
    """:class:`UntrustedCheckpointError` when another user could change the checkpoint
    folder ``path`` (:func:`open_entry`)."""
    found = open_entry(path)
    if found is None:
        return
    where, reason = found
    raise UntrustedCheckpointError(
        f"refusing to load {path}: {where} {reason}, so another user could have changed the "
        f"checkpoint; load it only if you trust whoever can write there (trusted=True)",
        file=str(where),
    )


def verify_files(
    path: Path, manifest: _manifest.Manifest, metadata: Metadata, ranks: Ranks, checksum: bool
) -> None:
    """Sizes (and with ``checksum`` SHA-256) of every file, split across the ranks."""
    problems: list[tuple[str, str]] = []
    if ranks.rank == 0:
        for name, need in storage_extents(metadata).items():
            if name not in manifest.files:
                problems.append((str(path / name), f"{path / name}: not listed in the manifest"))
            elif manifest.files[name].size < need:
                problems.append(
                    (str(path / name), f"{path / name}: manifest size below data extent")
                )
    for i, name in enumerate(sorted(manifest.files)):
        if i % ranks.size == ranks.rank:
            message = _manifest.verify_file(path, name, manifest.files[name], checksum=checksum)
            if message is not None:
                problems.append((str(path / name), message))
    all_problems = sorted({p for per_rank in ranks.all_gather(problems) for p in per_rank})
    if all_problems:
        first_file = all_problems[0][0]
        text = "; ".join(m for _, m in all_problems)
        raise CorruptCheckpointError(f"checkpoint {path} is damaged: {text}", file=first_file)


#: Items of a long mismatch list a message names; the error's attribute holds them all.
_LISTED = 3


def _counted(items: list[str], noun: str) -> str:
    """``"28 tensors: a; b; c; and 25 more"``, or all of a short list."""
    return f"{len(items)} {noun}{'s' if len(items) != 1 else ''}: {first_few(items, _LISTED)}"


def _model_targets(
    current: dict[str, Any], metadata: Metadata, strict: bool, owned: set[int] | None = None
) -> tuple[dict[str, Any], list[str], list[str]]:
    saved = {
        path[1]: metadata.state_dict_metadata[key]
        for key, path in section_paths(metadata, "model").items()
        if len(path) == 2
    }
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    shapes = []
    for key in sorted(set(current) & set(saved)):
        entry, value = saved[key], current[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                shapes.append(f"{key}: checkpoint holds a non-tensor value")
            elif tuple(entry.size) != tuple(value.shape):
                shapes.append(
                    f"{key}: checkpoint shape {tuple(entry.size)}, model shape {tuple(value.shape)}"
                )
    if shapes:
        raise IncompatibleCheckpointError(
            f"checkpoint does not fit the model: shape mismatch for {_counted(shapes, 'tensor')}"
            + ("; every one in error.shape_mismatches" if len(shapes) > _LISTED + 1 else ""),
            missing_keys=missing,
            unexpected_keys=unexpected,
            shape_mismatches=shapes,
        )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(
                f"missing keys (in the model, not in the checkpoint): {_counted(missing, 'key')}"
            )
        if unexpected:
            parts.append(
                "unexpected keys (in the checkpoint, not in the model): "
                + _counted(unexpected, "key")
            )
        raise IncompatibleCheckpointError(
            "checkpoint does not fit the model (strict=True): "
            + "; ".join(parts)
            + "; pass strict=False to load the common keys",
            missing_keys=missing,
            unexpected_keys=unexpected,
        )
    targets = {
        k: v.detach()  # the model's own tensor (``owned``: the load reads straight into it)
        if owned is not None and is_own(v, owned)
        else torch.empty_like(v)
        if isinstance(v, torch.Tensor)
        else v
        for k, v in current.items()
        if k in saved
    }
    return targets, missing, unexpected


def _optim_targets(
    names: dict[int, list[str]], current: dict[str, Any], metadata: Metadata, strict: bool
) -> tuple[dict[str, Any], list[str]]:
    """Buffers for the saved optimizer state of the parameters ``names``
    (``_model_state.param_names``): a state tensor shaped like its parameter is sharded like the
    parameter's value in the model state ``current`` (a DTensor or a torch FSDP1
    ``ShardedTensor``), any other one is read whole."""
    params = {name for fqns in names.values() for name in fqns}
    target: dict[str, Any] = {}
    unexpected = set()
    for key, path in section_paths(metadata, "optim").items():
        entry = metadata.state_dict_metadata[key]
        value = None
        if len(path) >= 3 and path[1] == "state":
            if path[2] not in params:
                unexpected.add(path[2])
                continue
            if isinstance(entry, TensorStorageMetadata):
                dtype = entry.properties.dtype
                like = current.get(path[2])
                if _sharded(like) and tuple(entry.size) == tuple(like.shape):
                    value = torch.empty_like(like, dtype=dtype)
                else:
                    value = torch.empty(tuple(entry.size), dtype=dtype)
        set_element(target, path[1:], value)
    if unexpected and strict:
        raise IncompatibleCheckpointError(
            "checkpoint optimizer state names parameters the model does not have: "
            f"{sorted(unexpected)}; pass strict=False to skip them",
            unexpected_keys=sorted(unexpected),
        )
    target.setdefault("state", {})
    target.setdefault("param_groups", [])
    return target, sorted(f"optim:{u}" for u in unexpected)


def _sharded(value: Any) -> bool:
    return isinstance(value, (DTensor, ShardedTensor))


def _check_param_groups(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loaded: dict[str, Any],
    names: dict[int, list[str]],
) -> None:
    expected = _model_state.optimizer_param_groups(model, optimizer, names)
    got = [list(g.get("params", [])) for g in loaded.get("param_groups", [])]
    if [sorted(g) for g in got] != [sorted(g) for g in expected]:
        raise IncompatibleCheckpointError(
            "checkpoint optimizer parameter groups do not match the optimizer's: "
            f"checkpoint {got}, optimizer {expected}"
        )


def unwrap_dcp_error(exc: BaseException) -> BaseException:
    """DCP reports per-rank failures as ``(exception, traceback)`` pairs inside a
    ``CheckpointException`` (a ``BaseException``): surface ours, wrap the others."""
    if isinstance(exc, CheckpointException):
        causes = []
        for failure in exc.failures.values():
            found = failure[0] if isinstance(failure, tuple) else failure
            causes.append(found)
            while found is not None and not isinstance(found, CheckpointError):
                found = found.__cause__
            if isinstance(found, CheckpointError):
                return found
        first = causes[0] if causes else exc
        return CorruptCheckpointError(
            f"reading the checkpoint failed: {type(first).__name__}: {first}"
        )
    return exc


@dataclass
class _Targets:
    """The buffers one load reads into, and what it found missing or unexpected."""

    state: dict[str, Any]
    missing: list[str]
    unexpected: list[str]
    #: The model's keys read straight into the model's own tensors (``in_place``).
    live: set[str] = field(default_factory=set)
    #: ``_model_state.param_names(model)``, computed once for the optimizer's steps.
    param_names: dict[int, list[str]] = field(default_factory=dict)


def _targets(
    folder: Path,
    manifest: _manifest.Manifest,
    metadata: Metadata,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    objects: Mapping[str, _stateful.Stateful],
    *,
    strict: bool,
    ranks: Ranks,
    in_place: bool = False,
    current: dict[str, Any] | None = None,
) -> _Targets:
    owned = owned_storages(model) if in_place else None
    current = _model_state.model_state(model) if current is None else current
    model_target, missing, unexpected = _model_targets(current, metadata, strict, owned)
    state: dict[str, Any] = {"model": model_target}
    names = _model_state.param_names(model) if optimizer is not None else {}
    if optimizer is not None:
        if not manifest.has_optimizer:
            if strict:
                raise IncompatibleCheckpointError(
                    f"checkpoint {folder} holds no optimizer state (saved without an "
                    "optimizer); load with optimizer=None or strict=False",
                    missing_keys=["optim"],
                )
            missing = [*missing, "optim"]
        else:
            state["optim"], optim_unexpected = _optim_targets(names, current, metadata, strict)
            unexpected = [*unexpected, *optim_unexpected]
    stateful_target, stateful_missing = _stateful.load_targets(
        objects,
        manifest.stateful,
        metadata,
        saved_world_size=manifest.world_size,
        ranks=ranks,
        strict=strict,
    )
    state.update(stateful_target)
    live = {k for k, v in model_target.items() if owned is not None and is_own(v, owned)}
    return _Targets(state, [*missing, *stateful_missing], unexpected, live, names)


def _agreed(ranks: Ranks, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; a CheckpointError on any rank raises on all."""
    result, error = None, None
    try:
        result = fn()
    except CheckpointError as exc:
        error = exc
    ranks.agree(error)
    return result  # type: ignore[return-value]


def _read(state: dict[str, Any], folder: Path, metadata: Metadata, ranks: Ranks) -> None:
    """``safe_load`` of ``state`` from ``folder`` (whose ``metadata`` was read); the same
    error on every rank.

    Each rank plans and reads its own part alone: DCP's load planning involves no global
    coordination (``create_default_global_load_plan`` returns the ranks' plans unchanged),
    so its collectives would only gather the plans on rank 0 and make the others wait for
    it. The one agreement that matters, whether every rank read everything, is ours.
    """
    error: BaseException | None = None
    try:
        safe_load(state, folder, metadata=metadata)
    except (Exception, CheckpointException) as exc:
        error = unwrap_dcp_error(exc)
        if not isinstance(error, CheckpointError):
            error = CheckpointError(
                f"reading checkpoint {folder} failed on rank {ranks.rank}: "
                f"{type(error).__name__}: {error}"
            )
    ranks.agree(error)


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    stateful: Mapping[str, _stateful.Stateful] | None = None,
    strict: bool = True,
    verify: bool = True,
    in_place: bool = False,
    trusted: bool = False,
) -> LoadReport:
    """Load the checkpoint folder ``path`` into ``model`` (and ``optimizer``, and the
    ``stateful`` objects); collective.

    Every rank of the default process group calls it. The checkpoint may come from any
    world size. ``strict=True``: any missing/unexpected model key, or a ``stateful`` name
    the checkpoint lacks, raises :class:`IncompatibleCheckpointError` listing them;
    ``strict=False``: the common part is loaded and the rest is reported in the returned
    :class:`LoadReport` (objects without saved state are left as they are). Shape
    mismatches and a Stateful saved per rank but loaded into a global one (or the reverse)
    always raise. Saved Stateful objects not named in ``stateful`` are not read.
    Resharding: a global Stateful gets its one saved state on every rank; a per-rank one
    (:class:`PerRankStateful`) gets rank ``r``'s saved state at the same world size and
    ``reshard_state(saved_states, rank, world_size)`` at another. ``verify=True`` checks
    every file's SHA-256 first (split across ranks); ``verify=False`` checks sizes only.
    Nothing is written into the model, optimizer or Stateful objects unless every check
    and every read succeeded. A running :func:`async_save` of this process is waited for
    first. ``in_place``: the model's state is read straight into the model's own tensors
    where they are its storage (:mod:`._in_place`; one copy less), last, after the
    Stateful objects took theirs (a read that fails then, which no check caught, leaves
    the model partly loaded).

    Only this user's checkpoints load: one another user could have changed (a folder on
    the way to it, the checkpoint's folder or one of its files can be written by another
    user, or is owned by one), and one whose seal does not hold under this user's
    checkpoint key (another user's, one saved before checkpoints were sealed, or one
    planted with recomputed checksums), raise :class:`UntrustedCheckpointError` naming
    the folder or file. ``trusted=True`` skips both checks, for a checkpoint the caller
    knows to be sound (a colleague's); sizes and checksums are still checked, and nothing
    is unpickled freely.
    """
    return load_with_state(
        path,
        model,
        optimizer,
        stateful=stateful,
        strict=strict,
        verify=verify,
        in_place=in_place,
        model_state=None,
        trusted=trusted,
    )


@quietly
def load_with_state(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    stateful: Mapping[str, _stateful.Stateful] | None,
    strict: bool,
    verify: bool,
    in_place: bool,
    model_state: dict[str, Any] | None,
    trusted: bool = False,
) -> LoadReport:
    """:func:`load`, given ``model_state``: ``_model_state.model_state(model)`` as the caller
    computed it since the model last changed (``None``: computed here), so that a caller
    that compared keys first does not compute it twice."""
    objects = _stateful.check_stateful(stateful)
    started = time.monotonic()
    ranks = Ranks()
    INFLIGHT.make_room("wait", ranks)
    folder = Path(path).absolute()
    found = _agreed(ranks, lambda: check_folder(folder, trusted=bool(trusted)))
    manifest, metadata, extra = found
    logger.info(
        "load %s: step %s, saved by %d ranks (%d files, stateful %s); loading on %d ranks%s",
        folder,
        manifest.step,
        manifest.world_size,
        len(manifest.files),
        sorted(manifest.stateful),
        ranks.size,
        " (resharding)" if manifest.world_size != ranks.size else "",
    )
    verify_files(folder, manifest, metadata, ranks, verify)
    targets = _agreed(
        ranks,
        lambda: _targets(
            folder,
            manifest,
            metadata,
            model,
            optimizer,
            objects,
            strict=strict,
            ranks=ranks,
            in_place=in_place,
            current=model_state,
        ),
    )
    model_state = targets.state["model"]
    buffers = {k: v for k, v in model_state.items() if k not in targets.live}
    read_started = time.monotonic()
    _read({**targets.state, "model": buffers}, folder, metadata, ranks)
    logger.info("rank %d read its buffers in %.3fs", ranks.rank, time.monotonic() - read_started)

    def check_and_reshard() -> dict[str, Any]:
        if "optim" in targets.state:
            _check_param_groups(model, optimizer, targets.state["optim"], targets.param_names)
        return _stateful.states_to_apply(
            objects, targets.state, saved_world_size=manifest.world_size, ranks=ranks
        )

    states = _agreed(ranks, check_and_reshard)  # neither step is collective: one agreement
    error = None
    for name, state in states.items():
        try:
            objects[name].load_state_dict(state)
        except Exception as exc:
            error = CheckpointError(
                f"stateful[{name!r}].load_state_dict failed: {type(exc).__name__}: {exc}"
            )
            break
    ranks.agree(error)

    if buffers or not in_place:
        _model_state.apply_model_state(model, buffers)
    if in_place:  # collective (the agreement): every rank reads, also one with nothing in place
        _read({"model": {k: model_state[k] for k in targets.live}}, folder, metadata, ranks)
    if "optim" in targets.state:
        _model_state.apply_optimizer_state(
            model, optimizer, targets.state["optim"], targets.param_names
        )
    return LoadReport(
        path=str(folder),
        step=manifest.step,
        saved_world_size=manifest.world_size,
        world_size=ranks.size,
        loaded_optimizer="optim" in targets.state,
        missing_keys=list(targets.missing),
        unexpected_keys=list(targets.unexpected),
        extra=extra,
        seconds=time.monotonic() - started,
        loaded_stateful=sorted(states),
    )
