"""Rank side: where a job's rank is right now, read without stopping it.

:func:`rank_state` looks at the training thread's Python stack (from another thread:
``sys._current_frames``), the rank's flight recorder and its memory, and returns a
:class:`pool.common._job_status.RankState`. Nothing is added to the training loop for
this: the phase is read from the stack when someone asks.

* phase: the outermost of these frames on the stack: an optimizer's ``step``
  (``torch/optim/``) is ``optimizer``; autograd's backward is ``backward``; a module's
  call (``nn.Module.__call__``) is ``forward``; a rank stopped at a step boundary is
  ``paused``; anything else is ``outside training`` (data loading, logging, a
  checkpoint...). A forward recomputed inside backward (activation checkpointing) is
  ``backward``.
* collective: when the thread waits inside ``torch.distributed`` (or, for NCCL, behind a
  collective unfinished on the GPU), the oldest collective its recorder holds unfinished,
  and for how long (the recorder's creation time).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from fsdp_interactive.pool.common._collectives import CollectiveRecord, RecorderDump
from fsdp_interactive.pool.common._job_status import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    OUTSIDE,
    PAUSED,
    RankState,
)
from fsdp_interactive.pool.common._stacks import Frame, describe, in_distributed, user_frames
from fsdp_interactive.pool.rank import _thread_stacks, _torch_recorder
from fsdp_interactive.pool.rank._thread_stacks import CodeName

_BACKWARD_FUNCTIONS = {
    ("torch/_tensor.py", "backward"),
    ("torch/autograd/__init__.py", "backward"),
    ("torch/autograd/__init__.py", "grad"),
    ("torch/autograd/graph.py", "_engine_run_backward"),
}
_FORWARD_FUNCTIONS = {
    ("torch/nn/modules/module.py", "_call_impl"),
    ("torch/nn/modules/module.py", "_wrapped_call_impl"),
}


def phase_of(frames: list[Frame]) -> str:
    """The training phase of a stack (innermost first): see the module."""
    for frame in reversed(frames):  # outermost first
        path = frame.file.replace("\\", "/")
        if "/torch/optim/" in path:
            return OPTIMIZER
        if any(path.endswith(f) and frame.function == fn for f, fn in _BACKWARD_FUNCTIONS):
            return BACKWARD
        if any(path.endswith(f) and frame.function == fn for f, fn in _FORWARD_FUNCTIONS):
            return FORWARD
    return OUTSIDE


def ready_recorder() -> None:
    """Have :mod:`._torch_recorder` check the recorder once the job's group issued its
    first collective (a check before would find nothing recorded, and say torch does not
    record); until then its dumps say it was not checked yet."""
    if _torch_recorder.checked():
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    if _torch_recorder.buffer_size() <= 0 or _torch_recorder.recorded_any():
        _torch_recorder.check(str(dist.get_backend()))


def recorder_dump(last: int | None = None, code_name: CodeName | None = None) -> RecorderDump:
    """This rank's recorder (see :func:`ready_recorder`)."""
    ready_recorder()
    return _torch_recorder.dump(last, code_name)


def waited_in(frames: list[Frame], dump: RecorderDump) -> CollectiveRecord | None:
    """The collective a thread with the stack ``frames`` waits in: the oldest unfinished
    one, when the thread is inside ``torch.distributed`` or NCCL work is unfinished."""
    unfinished = [r for r in dump.records if r.completed is False]
    if not unfinished:
        return None
    if in_distributed(frames) is None and not any(r.stream_ordered for r in unfinished):
        return None
    return min(unfinished, key=lambda r: (r.group != "0", r.seq))


def _memory() -> dict[str, Any]:
    import psutil

    figures: dict[str, Any] = {"rss_bytes": int(psutil.Process(os.getpid()).memory_info().rss)}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        # The training thread's device is not this thread's: take the device it holds.
        devices = [(torch.cuda.memory_reserved(i), i) for i in range(torch.cuda.device_count())]
        reserved, index = max(devices)
        if reserved:
            figures.update(
                device=f"cuda:{index}",
                allocated_bytes=int(torch.cuda.memory_allocated(index)),
                reserved_bytes=int(reserved),
            )
    return figures


def _backend() -> str:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return "-"


def _where(frames: list[Frame], frame: Any, paused: bool, step: int) -> str:
    if paused:
        return f"after step {step}" + (f", {describe(frames)}" if frames else "")
    return describe(frames) if frame is not None else "the training thread has ended"


def rank_state(
    rank: int,
    thread: int,
    *,
    step: int,
    paused: bool = False,
    paused_frame: Any = None,
    pause_target: int | None,
    code_name: CodeName | None = None,
) -> RankState:
    """This rank's state (see the module); ``thread``: the training thread's ident;
    ``paused_frame``: the frame a paused rank stopped in (the training loop's)."""
    frame = paused_frame if paused else sys._current_frames().get(thread)
    frames = user_frames(_thread_stacks.frame_records(frame, code_name)) if frame else []
    dump = recorder_dump(64, code_name)
    waiting = waited_in(frames, dump) if not paused else None
    collective = None
    if waiting is not None:
        label = "" if waiting.group == "0" else f"group {waiting.group} "
        collective = f"{label}{waiting.op} #{waiting.seq}"
    return RankState(
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        step=step,
        phase=PAUSED if paused else phase_of(frames),
        where=_where(frames, frame, paused, step),
        collective=collective,
        waiting_s=waiting.pending_s if waiting is not None else None,
        pause_target=pause_target,
        backend=_backend(),
        **_memory(),
    )
