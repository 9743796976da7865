"""What an engine launcher can tell while its engines have not registered yet.

ipyparallel's engine *set* launchers differ in what they know: ``mpiexec`` is one local
process (``MPIEngineSetLauncher``) whose exit ends every rank; a SLURM job
(``SlurmEngineSetLauncher``) is known only by its id, and ipyparallel never asks the
queue about it; ssh and local launchers keep one launcher per engine (those are
watched engine by engine, see :mod:`._launched`). :func:`launch_problem` turns what
can be learned about a set into one message when the engines can no longer register,
so that start-up fails at once with the launcher's own output instead of at the
timeout; :func:`launch_state` says where a set stands for the timeout's message.

SLURM states are read with ``squeue -h -j ID -o "%T|%r"`` (at most every
:data:`SQUEUE_EVERY_S` seconds per job). A job that pends for a reason SLURM gives
when it can never run as submitted (:data:`NEVER_RUNS`) fails at once; one that pends
for resources or priority is waited for until the start-up timeout.

Not done: PBS, SGE, LSF and HTCondor jobs (only their launchers' exit is watched).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between two ``squeue`` calls about the same job.
SQUEUE_EVERY_S = 2.0
_SQUEUE_TIMEOUT_S = 10.0
_OUTPUT_TAIL_LINES = 30
#: Pending reasons with which a SLURM job never starts as submitted.
NEVER_RUNS = frozenset(
    {
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "PartitionConfig",
        "BadConstraints",
        "DependencyNeverSatisfied",
        "InvalidAccount",
        "InvalidQOS",
        "QOSJobLimit",
        "AssocMaxNodesPerJobLimit",
        "AssocMaxCpuPerJobLimit",
    }
)
#: Job states after which no engine of the job runs.
ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


@dataclass
class JobState:
    """A batch job's ``state`` and ``reason`` as ``squeue`` shows them (``state`` is
    ``"gone"`` when the queue no longer lists the job)."""

    job_id: str
    state: str
    reason: str = ""

    def __str__(self) -> str:
        reason = f" ({self.reason})" if self.reason and self.reason != "None" else ""
        return f"{self.state}{reason}"


_last_asked: dict[str, tuple[float, JobState | None]] = {}


def slurm_job_state(job_id: str, *, fresh: bool = False) -> JobState | None:
    """The job's state from ``squeue`` (``None`` when squeue cannot be asked).

    Answers are reused for :data:`SQUEUE_EVERY_S` seconds unless ``fresh``.
    """
    now = time.monotonic()
    asked = _last_asked.get(job_id)
    if asked is not None and not fresh and now - asked[0] < SQUEUE_EVERY_S:
        return asked[1]
    squeue = shutil.which("squeue")
    state: JobState | None = None
    if squeue is not None:
        try:
            out = subprocess.run(
                [squeue, "-h", "-j", job_id, "-o", "%T|%r"],
                capture_output=True,
                text=True,
                timeout=_SQUEUE_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("squeue -j %s failed: %s", job_id, exc)
        else:
            line = out.stdout.strip().splitlines()[:1]
            if line:
                job_state, _, reason = line[0].partition("|")
                state = JobState(job_id, job_state.strip(), reason.strip())
            elif out.returncode == 0 or "Invalid job id" in out.stderr:
                state = JobState(job_id, "gone")
            else:
                log.debug("squeue -j %s: %s", job_id, out.stderr.strip())
    _last_asked[job_id] = (now, state)
    return state


def launch_problem(engine_set: Any) -> str | None:
    """Why the engines of ``engine_set`` can no longer register, or ``None``.

    A set launcher that is one process (``mpiexec``) and has exited; a SLURM job that
    ended or can never run. The message carries the launcher's (or job's) last output.
    """
    job_id = getattr(engine_set, "job_id", "")
    if job_id and _is_slurm(engine_set):
        state = slurm_job_state(job_id)
        if state is None:
            return None
        if state.state in ENDED or state.state == "gone":
            return (
                f"SLURM job {job_id} ended ({state}) before its engines registered; "
                f"the last lines of its output:\n{_output_tail(engine_set)}"
            )
        if state.state == "PENDING" and state.reason in NEVER_RUNS:
            return (
                f"SLURM job {job_id} can never run as submitted: squeue shows it PENDING "
                f"({state.reason}); check the batch script's #SBATCH lines against the "
                "partition (sinfo). The pool cancelled it (scancel "
                f"{job_id}); if squeue still lists it, run scancel {job_id}"
            )
        return None
    if getattr(engine_set, "launchers", None) is not None:
        return None  # one launcher per engine: watched engine by engine
    if getattr(engine_set, "state", "") == "after":
        stop_data = getattr(engine_set, "stop_data", None) or {}
        code = stop_data.get("exit_code") if isinstance(stop_data, dict) else None
        return (
            f"the engine launcher ({_command(engine_set)}) exited with status {code} "
            f"before the engines registered; the last lines of its output:\n"
            f"{_output_tail(engine_set)}"
        )
    return None


def launch_state(engine_set: Any) -> str:
    """One line on where ``engine_set`` stands ("" when there is nothing to add)."""
    job_id = getattr(engine_set, "job_id", "")
    if job_id and _is_slurm(engine_set):
        state = slurm_job_state(job_id, fresh=True)
        shown = str(state) if state is not None else "unknown (squeue did not answer)"
        return (
            f"SLURM job {job_id} is {shown} in squeue; the pool cancels it (scancel "
            f"{job_id}); if squeue still lists it afterwards, run scancel {job_id}"
        )
    if getattr(engine_set, "launchers", None) is None and getattr(engine_set, "state", ""):
        tail = _output_tail(engine_set)
        return f"the engine launcher ({_command(engine_set)}) is {engine_set.state}" + (
            f"; the last lines of its output:\n{tail}" if tail.strip() else ""
        )
    return ""


def _is_slurm(engine_set: Any) -> bool:
    return any(cls.__name__ == "SlurmLauncher" for cls in type(engine_set).__mro__)


def _command(engine_set: Any) -> str:
    args = getattr(engine_set, "args", None) or []
    return str(args[0]) if args else type(engine_set).__name__


def _output_tail(engine_set: Any, lines: int = _OUTPUT_TAIL_LINES) -> str:
    """The last lines of what the launcher (or job) wrote ("" when nothing can be read)."""
    text = ""
    path = getattr(engine_set, "output_file", "")
    # Read the file itself while it exists: ipyparallel's get_output() keeps its first
    # answer forever, and the launcher deletes the file when it notices the exit.
    if path:
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            text = f.read()
    if not text:
        try:
            text = engine_set.get_output(remove=False) or ""
        except Exception as exc:  # a launcher's output is best effort
            log.debug("no output from %s: %s", type(engine_set).__name__, exc)
    return "".join(text.splitlines(keepends=True)[-lines:])
