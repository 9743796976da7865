"""What the calls of an attached job (:mod:`._attached_job`) raise, besides the pool's
own errors (:class:`~.errors.RankError` for a cell that failed on a rank).

Each names what to do next, in API calls (``job.pause()``) and, in
:meth:`~.errors.Advised.notebook_message`, in magics (``%fsdp pause``).
"""

from __future__ import annotations

from fsdp_interactive.pool.errors import Advised, PoolError, Step

ATTACH = Step("attach again with {}", "fsdp_interactive.attach(...)", "%fsdp attach")
PAUSE = Step("pause it at a step boundary first with {}", "job.pause()", "%fsdp pause")
DETACH = Step("detach with {}", "job.detach()", "%fsdp detach")
STATUS = Step("see every rank with {}", "job.status()", "%fsdp status")


class AttachError(PoolError):
    """No job could be attached to: none found, several, ranks missing, a record that is
    not this user's, a wrong key, or another notebook attached."""


class JobError(Advised, PoolError):
    """An attached job cannot do what was asked now; the message says why and what to do."""

    def __init__(self, message: str, *steps: Step):
        self._head = message
        self.advice = steps
        super().__init__(self._compose(False))


class JobNotPaused(JobError):
    """Work that runs on the job's ranks (cells, views, pulls) needs the job paused."""

    def __init__(self, job: str):
        super().__init__(
            f"job {job} is running; cells, views, pulls and snapshots run on its ranks only "
            "while it is paused at a step boundary",
            PAUSE,
        )


class JobRanksGone(JobError):
    """Ranks of the attached job ended (``exited``: normally; ``died``: their link closed
    without a goodbye, the process was killed or its host went). The job's own failure
    handling (torchrun's, SLURM's) decides what happens to the others; the notebook only
    reports it."""

    def __init__(self, job: str, exited: list[int], died: list[int], hosts: dict[int, str]):
        self.exited, self.died = sorted(exited), sorted(died)
        parts = []
        if self.died:
            where = ", ".join(f"rank {r} (on {hosts.get(r, '?')})" for r in self.died)
            parts.append(
                f"{where} of job {job} died: its link to this notebook closed without a "
                "goodbye (the process was killed or ended abnormally, or its host went away); "
                "the job's own failure handling (torchrun's, SLURM's) decides what happens "
                "to the other ranks"
            )
        if self.exited:
            parts.append(f"ranks {self.exited} of job {job} exited (the job is ending)")
        super().__init__("\n".join(parts), STATUS, DETACH)
