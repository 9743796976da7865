"""The engine pool: an ipyparallel cluster whose every engine is one ``torch.distributed`` rank.

Notebook side. ``Pool`` is the entry point; the exceptions below (defined in
:mod:`fsdp_interactive.pool.errors`) are what its calls raise, and ``Pool.state`` is a
:class:`PoolState` (``Pool.check()`` returns a :class:`PoolHealth`). ``Pool.trace()`` returns a :class:`CollectiveTrace` (per rank a
:class:`RecorderDump`), ``Pool.interrupt()`` an :class:`InterruptReport` and
``Pool.debug()`` a :class:`DebuggerOutput`. ``check_ssh_hosts(config)`` asks the ssh
hosts of an ipyparallel config whether they answer with this kernel's versions. A run's
``on_output`` sink gets each chunk of the ranks' text and, through its ``display``
method when it has one, each :class:`RankDisplay` they publish, and through its ``hang``
method a running call's :class:`HangNotice` (``None`` when it goes away). ``attach()``
returns an :class:`AttachedJob`: the ranks of a running job started with
``fsdp_interactive.attachable``, driven like a pool (:class:`JobStatus`,
:class:`HangReport`; :class:`AttachError`, :class:`JobError`, :class:`JobNotPaused`,
:class:`JobRanksGone`). Rank-side start-up code lives in
:mod:`fsdp_interactive.pool.rank._bootstrap` (free of IPython).
"""

from fsdp_interactive._lazy_exports import public_names
from fsdp_interactive.pool._attach_errors import AttachError, JobError, JobNotPaused, JobRanksGone
from fsdp_interactive.pool._attached_job import AttachedJob, HangReport, JobStatus, attach
from fsdp_interactive.pool._export import ExportPlan, ExportRefused
from fsdp_interactive.pool._output import RankDisplay, RunResult, TaggedPrinter
from fsdp_interactive.pool._pool import Pool
from fsdp_interactive.pool._pool_state import PoolHealth, PoolState
from fsdp_interactive.pool._script_calls import ScriptRunError, ScriptStatus
from fsdp_interactive.pool.common._collectives import CollectiveTrace, RecorderDump
from fsdp_interactive.pool.common._topology import RankRecord
from fsdp_interactive.pool.diagnostics._hang_watch import HangNotice
from fsdp_interactive.pool.diagnostics._interrupt import InterruptReport
from fsdp_interactive.pool.diagnostics._post_mortem import DebuggerOutput
from fsdp_interactive.pool.errors import (
    PoolBusy,
    PoolError,
    PoolNotRunning,
    PoolStartError,
    RankDied,
    RankError,
    RankInterrupted,
    RankTimeout,
    RecoveryError,
)
from fsdp_interactive.pool.processes._devices import visible_cuda_device_count
from fsdp_interactive.pool.processes._ssh_check import check_hosts as check_ssh_hosts

__all__ = [
    "AttachError",
    "AttachedJob",
    "CollectiveTrace",
    "DebuggerOutput",
    "ExportPlan",
    "ExportRefused",
    "HangNotice",
    "HangReport",
    "InterruptReport",
    "JobError",
    "JobNotPaused",
    "JobRanksGone",
    "JobStatus",
    "Pool",
    "PoolBusy",
    "PoolError",
    "PoolHealth",
    "PoolNotRunning",
    "PoolStartError",
    "PoolState",
    "RankDied",
    "RankDisplay",
    "RankError",
    "RankInterrupted",
    "RankRecord",
    "RankTimeout",
    "RecorderDump",
    "RecoveryError",
    "RunResult",
    "ScriptRunError",
    "ScriptStatus",
    "TaggedPrinter",
    "attach",
    "check_ssh_hosts",
    "visible_cuda_device_count",
]

__dir__ = public_names(__name__)
