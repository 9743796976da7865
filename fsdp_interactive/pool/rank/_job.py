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
  its SHA-256 is the one the script was written with, then read as JSON (no pickle: a
  tensor inside is read with ``torch.load(weights_only=True)``; no code runs).
* :func:`set_generators`: this rank's generators as a cell started with them.
* :func:`run_script` / :func:`continue_script`: a torchrun script the notebook ran with
  ``%fsdp run`` (paused at a step, cells run, continued), run the same way here: on a
  thread, paused after the same optimizer steps, its globals and frames' locals bound in
  the exported script's namespace (:mod:`._script_run`). :func:`end` ends a run still
  paused when the script ends, and the group.

The values file's format (:func:`encode`, :func:`write_values`) is written by the kernel
(which needs torch only when it pushed tensors) and read here. Free of IPython; standard
library and torch only.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import stat
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from fsdp_interactive import _private_files

FORMAT = "fsdp-interactive-export-values-2"


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


def encode(value: Any) -> Any:
    """``value`` as JSON data that :func:`decode` gives back exactly: numbers, strings,
    ``None`` and lists as they are; bytes, tuples, dicts (any key type), complex numbers
    and tensors tagged (a tensor as the bytes of ``torch.save`` of a CPU copy, read back
    with ``weights_only``). ``TypeError`` for anything else."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, tuple):
        return {"tuple": [encode(item) for item in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, bytes | bytearray):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        buffer = io.BytesIO()
        torch.save(value.detach().cpu().clone(), buffer)
        return {"tensor": base64.b64encode(buffer.getvalue()).decode("ascii")}
    raise TypeError(f"a {type(value).__qualname__} cannot be written to an export's values file")


_TAGS = ("tuple", "dict", "bytes", "complex", "tensor")


def decode(data: Any) -> Any:
    """The value :func:`encode` wrote."""
    if isinstance(data, list):
        return [decode(item) for item in data]
    if not isinstance(data, dict):
        return data
    if len(data) != 1 or next(iter(data)) not in _TAGS:
        raise ExportedJobError(f"not a value of an export's values file: {sorted(data)}")
    ((tag, content),) = data.items()
    if tag == "tuple":
        return tuple(decode(item) for item in content)
    if tag == "dict":
        return {decode(k): decode(v) for k, v in content}
    if tag == "bytes":
        return base64.b64decode(content)
    if tag == "complex":
        return complex(*content)
    import torch

    return torch.load(io.BytesIO(base64.b64decode(content)), weights_only=True)


def write_values(path: str, values: Mapping[str, Any]) -> str:
    """Write ``values`` (the export's pushes, generators and scripts) to ``path`` as JSON
    (:func:`encode`), a private file (mode 0600, made anew: an existing file is replaced by
    rename, never written through); its SHA-256."""
    data = json.dumps({"format": FORMAT, "values": encode(dict(values))}).encode("utf-8")
    replace_private_file(path, data)
    return hashlib.sha256(data).hexdigest()


def replace_private_file(path: str, data: bytes) -> None:
    """``data`` as the file ``path``, private to this user (mode 0600): written to a new
    file beside it (never through an existing name or link), then renamed over it."""
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    _private_files.write_new_file(temporary, data)
    os.replace(temporary, path)


def load_values(script: str, name: str, sha256: str) -> dict[str, Any]:
    """The values file ``name`` beside ``script`` (the exported script's ``__file__``),
    checked (module docstring) and read without running any code."""
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
    content = json.loads(data.decode("utf-8"))
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ExportedJobError(f"{path} is not an fsdp_interactive export values file")
    return decode(content["values"])


def set_generators(values: Mapping[str, Any], entry: str) -> None:
    """Set this rank's generators to those journal entry ``entry`` started with (nothing
    when the notebook had no such rank, or its report of that entry was lost)."""
    import torch.distributed as dist

    from fsdp_interactive.pool.rank._cell_watch import apply_generators

    rank = dist.get_rank() if dist.is_initialized() else 0
    state = (values.get("generators") or {}).get(entry, {}).get(rank)
    if state is not None:
        apply_generators(state)


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
