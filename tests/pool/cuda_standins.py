"""Stand-ins for what needs a GPU, for the CPU tests of the pool's CUDA paths.

Each stands in for one CUDA/NCCL part only; everything around it is real:

* :class:`FakeCudaTensor`: a tensor that says it lives on ``cuda:0`` (``device``,
  ``is_cuda``) and holds its data on the CPU; ``.to("cpu")`` gives that data, as a CUDA
  tensor's copy would;
* :func:`nccl_dump`: the pickled dump of NCCL's flight recorder as torch lays it out
  (``FlightRecorder::dump``), with collectives that did or did not complete on the GPU;
* :func:`install_nccl_recorder`: makes this process's torch look built with NCCL's
  recorder (``_torch_compat.nccl_flight_recorder_dump``) returning such a dump.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch


class FakeCudaTensor(torch.Tensor):
    """A tensor whose ``device`` is ``cuda:0`` while its data stays on the CPU."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> FakeCudaTensor:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=data.dtype, device=torch.device("cuda", 0)
        )
        tensor.payload = data
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return args[0].payload.clone()
        if func is torch.ops.aten.detach.default:
            return FakeCudaTensor(args[0].payload)
        raise NotImplementedError(f"FakeCudaTensor does not run {func}")


def nccl_entry(
    seq: int, op: str = "all_reduce", *, completed: bool, group: str = "0", age_s: float = 30.0
) -> dict[str, Any]:
    """One entry of NCCL's flight recorder (the keys torch 2.13 writes)."""
    return {
        "record_id": seq,
        "pg_id": int(group.split("/")[0]) if group.split("/")[0].isdigit() else 0,
        "process_group": (group, "default_pg" if group == "0" else "sub"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": time.time_ns() - int(age_s * 1e9),
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "output_sizes": [[4]],
        "output_dtypes": ["Float"],
        "state": "completed" if completed else "scheduled",
        "retired": completed,
        "timeout_ms": 600000,
        "is_p2p": False,
        "frames": [],
    }


def nccl_dump(*entries: dict[str, Any]) -> bytes:
    """NCCL's recorder as ``_dump_nccl_trace`` returns it (pickled)."""
    status: dict[str, dict[str, int]] = {}
    for entry in entries:
        group = entry["process_group"][0]
        seen = status.setdefault(
            group, {"last_enqueued_collective": 0, "last_completed_collective": -1}
        )
        seen["last_enqueued_collective"] = max(
            seen["last_enqueued_collective"], entry["collective_seq_id"]
        )
        if entry["state"] == "completed":
            seen["last_completed_collective"] = max(
                seen["last_completed_collective"], entry["collective_seq_id"]
            )
    return pickle.dumps(
        {"version": "2.7", "entries": list(entries), "pg_status": status, "nccl_comm_state": {}}
    )


def install_nccl_recorder(*entries: dict[str, Any]) -> None:
    """From now on this process's NCCL recorder (as the pool reads it) holds ``entries``,
    and the recorder counts as checked (what a rank's join does)."""
    from fsdp_interactive import _torch_compat
    from fsdp_interactive.pool.rank import _torch_recorder

    payload = nccl_dump(*entries)
    _torch_compat.nccl_flight_recorder_dump = lambda: lambda *flags, **named: payload
    _torch_recorder._note = None
