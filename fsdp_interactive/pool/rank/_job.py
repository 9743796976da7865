"""What a script exported from a notebook session (``Pool.export``, ``%fsdp export``) calls
on each of its ranks, under ``torchrun`` or ``srun torchrun``: ``from fsdp_interactive
import job``.

* :func:`join`: the process group the pool's cells ran in (the pool's backend, this rank's
  device pinned as the pool pins it, the intra-op threads the pool's ranks had) and the
  names every ``%%fsdp`` cell found in its namespace: ``rank``, ``world_size``,
  ``local_rank``, ``device``.
* :func:`load_values`: the file written beside the script with the values the notebook
  pushed, the random generators every cell started with, and the source of the scripts
  it ran; refused unless it is a regular file of this user that nobody else can write and
  its SHA-256 is the one the script was written with, then read with
  ``torch.load(weights_only=True)`` (tensors and plain containers only: no code runs).
* :func:`set_generators`: this rank's generators as a cell started with them.
* :func:`run_script` / :func:`continue_script`: a torchrun script the notebook ran with
  ``%fsdp run`` (paused at a step, cells run, continued), run the same way here: on a
  thread, paused after the same optimizer steps, its globals and frames' locals bound in
  the exported script's namespace (:mod:`._script_run`). :func:`end` ends a run still
  paused when the script ends, and the group.

The values file's format (:func:`encode_values`, :func:`write_values`) is written by the
kernel and read here. Free of IPython; standard library and torch only.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from fsdp_interactive import _private_files

FORMAT = "fsdp-interactive-export-values-1"


class ExportedJobError(RuntimeError):
    """What an exported script refuses: a values file that is not the one it was written
    with, or that another user could have changed."""


# ---------------------------------------------------------------------------- the group


def join(backend: str, *, threads: int | None = None) -> tuple[int, int, int, Any]:
    """``init_process_group(backend)`` from torchrun's environment, this rank's device
    pinned (``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo) and ``threads`` intra-op
    threads (what the pool's ranks had: float sums depend on it); ``(rank, world_size,
    local_rank, device)`` as the pool's cells saw them."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if threads is not None:
        torch.set_num_threads(int(threads))
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def end() -> None:
    """End a script run still paused (as ``%fsdp continue --stop`` would) and the group."""
    import torch.distributed as dist

    from fsdp_interactive.pool.rank import _script_run

    run = _script_run.current()
    if run is not None and run.state == _script_run.PAUSED:
        run.go_on(None, True)
    if dist.is_initialized():
        dist.destroy_process_group()


def intra_op_threads() -> int:
    """This rank's intra-op threads (``torch.get_num_threads()``)."""
    import torch

    return int(torch.get_num_threads())


def restore(script: str, folder: str, namespace: MutableMapping[str, Any]) -> Any:
    """Load the snapshot persisted in ``folder`` (beside ``script`` unless absolute) into
    the objects its record names in ``namespace``, as a recovery restores
    (``fsdp_interactive.checkpoint.restore_snapshot``); collective."""
    from fsdp_interactive.checkpoint import restore_snapshot

    if not os.path.isabs(folder):
        folder = os.path.join(os.path.dirname(os.path.abspath(script)), folder)
    return restore_snapshot(folder, namespace)


# ---------------------------------------------------------------------------- values file


def encode_generators(state: Mapping[str, Any]) -> dict[str, Any]:
    """A generator state as :mod:`._cell_watch` captures it (bytes inside), in the values
    file's types: tensors and plain containers, as ``weights_only`` loading admits."""
    import torch

    encoded: dict[str, Any] = {}
    for key in ("torch", "cuda"):
        if key in state:
            encoded[key] = torch.frombuffer(bytearray(state[key]), dtype=torch.uint8).clone()
    if "python" in state:
        version, internal, gauss = state["python"]
        encoded["python"] = (int(version), tuple(int(v) for v in internal), gauss)
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        words = torch.frombuffer(bytearray(keys), dtype=torch.int32).clone()
        encoded["numpy"] = (str(name), words, int(pos), int(has_gauss), float(cached))
    return encoded


def decode_generators(encoded: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode_generators` (what ``_cell_watch.apply_generators`` takes)."""
    state: dict[str, Any] = {}
    for key in ("torch", "cuda"):
        if key in encoded:
            state[key] = bytes(encoded[key].tolist())
    if "python" in encoded:
        version, internal, gauss = encoded["python"]
        state["python"] = (version, tuple(internal), gauss)
    if "numpy" in encoded:
        name, words, pos, has_gauss, cached = encoded["numpy"]
        state["numpy"] = (name, words.numpy().tobytes(), pos, has_gauss, cached)
    return state


def write_values(path: str, values: Mapping[str, Any]) -> str:
    """Write ``values`` (the export's pushes, generators and scripts, in the file's types)
    to ``path`` as a private file (mode 0600, made anew: an existing file is replaced by
    rename, never written through); its SHA-256."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **values}, buffer)
    data = buffer.getvalue()
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    _private_files.write_new_file(temporary, data)
    os.replace(temporary, path)
    return hashlib.sha256(data).hexdigest()


def load_values(script: str, name: str, sha256: str) -> dict[str, Any]:
    """The values file ``name`` beside ``script`` (the exported script's ``__file__``),
    checked (module docstring) and read without running any code."""
    import io

    import torch

    path = os.path.join(os.path.dirname(os.path.abspath(script)), name)
    try:
        fd = _private_files.open_regular(path)
    except OSError as error:
        raise ExportedJobError(f"cannot read the values file {path}: {error}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ExportedJobError(
                f"{path} is not this user's own file (owner uid {info.st_uid}, mode "
                f"{stat.S_IMODE(info.st_mode):o}): another user could have changed it"
            )
        with os.fdopen(fd, "rb") as file:
            fd = -1
            data = file.read()
    finally:
        if fd >= 0:
            os.close(fd)
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise ExportedJobError(
            f"{path} is not the values file this script was exported with (SHA-256 {found}, "
            f"expected {sha256}); export the session again"
        )
    values = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(values, dict) or values.get("format") != FORMAT:
        raise ExportedJobError(f"{path} is not an fsdp_interactive export values file")
    return values


def set_generators(values: Mapping[str, Any], entry: str) -> None:
    """Set this rank's generators to those journal entry ``entry`` started with (nothing
    when the notebook had no such rank, or its report of that entry was lost)."""
    import torch.distributed as dist

    from fsdp_interactive.pool.rank._cell_watch import apply_generators

    rank = dist.get_rank() if dist.is_initialized() else 0
    encoded = (values.get("generators") or {}).get(entry, {}).get(rank)
    if encoded is not None:
        apply_generators(decode_generators(encoded))


# ---------------------------------------------------------------------------- script runs


def run_script(
    namespace: MutableMapping[str, Any],
    values: Mapping[str, Any],
    entry: str,
    *,
    path: str,
    args: list[str],
    cwd: str,
    stop_at: int | None,
) -> None:
    """Run the script the notebook ran as journal entry ``entry`` (its source as it ran,
    from the values file) as the pool ran it, pausing after step ``stop_at``; what it built
    is bound in ``namespace`` (the exported script's globals)."""
    from fsdp_interactive.pool.rank import _script_run

    source = values["scripts"][entry]
    spec = {
        "path": path,
        "source": source,
        "args": list(args),
        "cwd": cwd if os.path.isdir(cwd) else os.getcwd(),
        "stop_at": stop_at,
        "agree": True,
    }
    _script_run.start(namespace, spec, place=_torchrun_place(), set_environment=False)


def continue_script(
    namespace: MutableMapping[str, Any], *, stop_at: int | None, stop: bool = False
) -> None:
    """Resume the paused run as the notebook's ``%fsdp continue`` did."""
    from fsdp_interactive.pool.rank import _script_run

    _script_run.resume(namespace, {"stop_at": stop_at, "stop": stop})


def _torchrun_place() -> Any:
    import torch.distributed as dist

    from fsdp_interactive.pool.rank._torchrun_world import Place

    return Place(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        group_rank=int(os.environ.get("GROUP_RANK", "0")),
        group_world_size=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=os.environ.get("MASTER_PORT", "29500"),
        run_id=os.environ.get("TORCHELASTIC_RUN_ID", "none"),
        device=str(_device()),
        backend=str(dist.get_backend()),
    )


def _device() -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: ``from fsdp_interactive import job`` gives this module.
job = sys.modules[__name__]
