"""``%fsdp attach``, ``pause``, ``resume``, ``detach`` and ``stacks``: a running job's
ranks from the notebook.

``%fsdp attach`` makes the magics' pool an :class:`~fsdp_interactive.pool.AttachedJob`:
``%fsdp status``, ``%fsdp stacks`` and ``%fsdp trace`` then read the job's ranks without
stopping them; after ``%fsdp pause`` every ``%%fsdp`` cell, ``%fsdp pull``, ``%fsdp
snapshot`` and the views (``RankModel(current_pool(), "model")``) run on the job's
ranks, in their training threads; ``%fsdp resume`` lets the job go on and ``%fsdp
detach`` leaves it running as if never attached. ``%fsdp stacks`` works on a pool the
notebook started too.
"""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from fsdp_interactive.notebook._magic_session import Subcommands


def is_attached(pool: Any) -> bool:
    """Whether the magics' pool is an attached job (not a pool they started)."""
    return bool(getattr(pool, "attached", False))


class AttachCommands(Subcommands):
    """The attach subcommands of ``%fsdp``."""

    def _require_job(self, command: str) -> Any:
        if not is_attached(self.session.pool) or not self.session.pool.running:
            raise UsageError(
                f"%fsdp {command}: no job is attached; attach to a running job with "
                "%fsdp attach [FOLDER|SLURM_JOB_ID|NAME]"
            )
        return self.session.pool

    @magic_arguments()
    @argument("target", nargs="?", default=None, help="the job's folder, SLURM job id or name")
    @argument(
        "--attach-dir",
        default=None,
        help="where the job's records are (default: the job's default)",
    )
    @argument("--hosts", default=None, help="hosts to look for the job's ranks on, over ssh: a,b")
    @argument("--ssh-args", default="", help="arguments for ssh, e.g. '-F ~/.ssh/cluster'")
    @argument("--take-over", action="store_true", help="attach even while another notebook is")
    @argument(
        "--hang-after",
        type=float,
        default=60.0,
        help="seconds in a collective that %%fsdp status calls a hang",
    )
    @argument("--wait", type=float, default=0.0, help="seconds to wait for a job just started")
    def _fsdp_attach(self, rest: str) -> None:
        """Attach to a running job started with python -m fsdp_interactive.attachable (or
        fsdp_interactive.attachable() in its script): %fsdp status, stacks and trace then
        read its ranks without stopping them; %fsdp pause stops them after a step."""
        args = self.session.parse(self._fsdp_attach, rest, "attach")
        if self.session.pool is not None and self.session.pool.running:
            what = (
                f"job {self.session.pool.job}"
                if is_attached(self.session.pool)
                else f"a pool of {self.session.pool.world_size} ranks"
            )
            raise UsageError(
                f"%fsdp attach: this notebook already drives {what}; type %fsdp detach (or %fsdp stop) first"
            )
        if args.hang_after <= 0:
            raise UsageError(f"--hang-after {args.hang_after}: type seconds > 0")
        if args.wait < 0:
            raise UsageError(f"--wait {args.wait}: type seconds >= 0")
        from fsdp_interactive.pool import attach

        hosts = [h for h in args.hosts.split(",") if h] if args.hosts else None
        self.session.pool = attach(
            args.target,
            attach_dir=args.attach_dir,
            hosts=hosts,
            ssh_args=shlex.split(args.ssh_args),
            take_over=args.take_over,
            hang_after=args.hang_after,
            wait=args.wait,
        )
        job = self.session.pool
        hosts = len({r.host for r in job.topology})
        print(
            f"attached to job {job.job} ({job.world_size} ranks on {hosts} "
            f"host{'s' if hosts > 1 else ''}); type %fsdp status to see every rank, "
            "%fsdp pause to stop them after an optimizer step"
        )

    @magic_arguments()
    @argument("--at-step", type=int, default=None, help="the optimizer step to pause after")
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="give up (and withdraw the pause) after S seconds",
    )
    @argument(
        "--no-wait",
        action="store_true",
        help="arm the pause and return: the ranks stop when they get there",
    )
    def _fsdp_pause(self, rest: str) -> None:
        """Stop every rank of the attached job after the same optimizer step; %%fsdp cells,
        %fsdp pull, %fsdp snapshot and the views then run on its ranks."""
        args = self.session.parse(self._fsdp_pause, rest, "pause")
        job = self._require_job("pause")
        if args.at_step is not None and args.at_step < 1:
            raise UsageError(f"--at-step {args.at_step}: type an optimizer step number >= 1")
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout}: type seconds > 0")
        step = job.pause(at_step=args.at_step, timeout=args.timeout, wait=not args.no_wait)
        if args.no_wait:
            print(
                f"job {job.job} will pause after step {step}; %%fsdp cells wait for it, "
                "%fsdp pause waits too"
            )
            return
        print(
            f"job {job.job} paused after step {step} on all {job.world_size} ranks; %%fsdp cells "
            "run on its ranks now. Type %fsdp resume to let it go on."
        )

    def _fsdp_resume(self, rest: str) -> None:
        """Let the paused job go on."""
        self.session.no_arguments("resume", rest)
        job = self._require_job("resume")
        job.resume()
        print(f"job {job.job} runs on")

    def _fsdp_detach(self, rest: str) -> None:
        """Leave the attached job (resumed if paused); it runs on as if never attached."""
        self.session.no_arguments("detach", rest)
        self.detach()

    def detach(self) -> None:
        """Leave the attached job (``%fsdp detach``, and ``%fsdp stop`` of a job)."""
        job = self._require_job("detach")
        job.detach()
        self.session.pool = None
        print(f"detached from job {job.job}; it runs on as if never attached")

    @magic_arguments()
    @argument("--native", action="store_true", help="add native (C/C++) frames (py-spy)")
    def _fsdp_stacks(self, rest: str) -> None:
        """Every rank's stack with source lines, without stopping any (a pool's ranks or
        an attached job's)."""
        args = self.session.parse(self._fsdp_stacks, rest, "stacks")
        stacks, where = self.session.require_pool().stacks(native=args.native)
        for rank in sorted(stacks):
            print(f"--- rank {rank}: {where.get(rank, '')}")
            print(stacks[rank])

    def status(self) -> None:
        """``%fsdp status`` of an attached job: every rank's state, and a hang if any."""
        print("\n".join(self.session.pool.status().lines(notebook=True)))
