"""How an exported script is launched: its ``torchrun`` command line and its sbatch file
(kernel side, plain text).

The layout comes from the pool's topology (its hosts become nodes, its ranks per host
``--nproc-per-node``) unless ``nodes`` and ``per_node`` are given (``%fsdp export --nodes N
--gpus-per-node G``). One node: ``torchrun --standalone``. Several: each node's ``torchrun``
meets the others at a c10d rendezvous endpoint on the first node. The sbatch file asks
SLURM for the nodes (one task each, ``--gpus-per-node`` on GPU pools) and runs ``srun
torchrun`` with the endpoint on the job's first node and a port taken from the job id (jobs
of one user on one node do not collide). ``torchrun`` is the one installed beside the
kernel's Python (the same environment the pool's engines ran in).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_interactive.pool.common._topology import RankRecord

RENDEZVOUS_PORT = 29500


@dataclass(frozen=True)
class Layout:
    """``nodes`` x ``per_node`` ranks; ``gpus``: one CUDA device per rank."""

    nodes: int
    per_node: int
    gpus: bool

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def layout(topology: Sequence[RankRecord], nodes: int | None, per_node: int | None) -> Layout:
    """The job's layout: ``nodes`` and ``per_node`` where given, else the pool's."""
    for name, value in (("nodes", nodes), ("gpus_per_node", per_node)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a number >= 1 or None, got {value!r}")
    hosts = Counter(record.host for record in topology)
    gpus = any(record.device.startswith("cuda") for record in topology)
    return Layout(
        nodes=nodes if nodes is not None else max(1, len(hosts)),
        per_node=per_node if per_node is not None else max(hosts.values(), default=1),
        gpus=gpus,
    )


def torchrun() -> str:
    """The ``torchrun`` beside the kernel's Python (``python -m torch.distributed.run``
    where there is none)."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if os.access(beside, os.X_OK):
        return shlex.quote(beside)
    return f"{shlex.quote(sys.executable)} -m torch.distributed.run"


def command_line(script: str, plan: Layout, first_host: str | None = None) -> str:
    """The ``torchrun`` line that runs ``script`` (on every node, when there are several)."""
    if plan.nodes == 1:
        return f"{torchrun()} --standalone --nproc-per-node {plan.per_node} {shlex.quote(script)}"
    endpoint = f"{first_host or 'FIRST_NODE'}:{RENDEZVOUS_PORT}"
    return (
        f"{torchrun()} --nnodes {plan.nodes} --nproc-per-node {plan.per_node} "
        f"--rdzv-backend c10d --rdzv-endpoint {endpoint} {shlex.quote(script)}"
    )


def sbatch_text(script: str, plan: Layout, job_name: str) -> str:
    """An sbatch file running ``script`` with ``srun torchrun`` on ``plan``'s nodes."""
    folder = os.path.dirname(os.path.abspath(script))
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={plan.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if plan.gpus:
        lines.append(f"#SBATCH --gpus-per-node={plan.per_node}")
    lines += [
        f"#SBATCH --output={job_name}-%j.out",
        "#",
        f"# {plan.nodes} node(s) x {plan.per_node} rank(s): one torchrun per node (srun), meeting",
        "# at a c10d rendezvous on the job's first node.",
        "set -euo pipefail",
        f"cd {shlex.quote(folder)}",
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port=$(( {RENDEZVOUS_PORT} + SLURM_JOB_ID % 1000 ))",
        f"srun --ntasks-per-node=1 {torchrun()} --nnodes {plan.nodes} "
        f"--nproc-per-node {plan.per_node} \\",
        '    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$first_node:$port" \\',
        f"    {shlex.quote(os.path.abspath(script))}",
        "",
    ]
    return "\n".join(lines)
