"""Two simulated hosts x two ranks: ``Pool.start()`` and cell dispatch against torchrun.

Needs the simulated hosts of ``tests/multihost/testhosts.py`` (root; ``python -m
tests.multihost.testhosts --state DIR up``) and ``FSDPI_TESTHOSTS=DIR``. Contenders:

* ``Pool(4).start()`` (ours) with ``engines="ssh"``, two engines on each host: one ssh
  command per host runs an engine forker there, which imports torch once and forks
  that host's engines; timed until ``start()`` returns; the pool is stopped (untimed,
  forkers included) before the next sample;
* the same with ipyparallel's MPI launcher (``mpiexec`` over the hosts' ssh, each engine
  a fresh interpreter): the path SLURM and MPI pools take, for comparison;
* ``torchrun --nnodes 2 --nproc-per-node 2`` with c10d rendezvous on hosta's address,
  one launcher started in each host's namespaces, of ``bench/scripts/noop_rank.py``:
  timed to rank 0's ``READY`` (a usable group) and to both launchers' exit (what a
  relaunch costs);
* ``Pool.restart()`` of a started 2x2 ssh pool (ours): a fresh group forked from the
  hosts' forkers, which the restart keeps (what a recovery starts from);
* ``Pool.run("pass")`` on a started 2x2 ssh pool (ours): one round trip to every rank.

Start samples rotate ssh pool / MPI pool / torchrun; medians with their ranges and paired
ratios are reported. Target: the ssh pool's start at most torchrun's time to a ready group.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from bench.availability import missing
from bench.runner import (
    Comparison,
    FigureResult,
    Settings,
    Stat,
    Target,
    figure_main,
    measure,
    rotated,
)
from bench.torchrun import NOOP_SCRIPT, Relaunch

HOSTS, PER_HOST = 2, 2
POOL_START = "Pool(4).start(), 2 hosts x 2 (ours, ssh: a forker per host)"
MPI_START = "Pool(4).start(), 2 hosts x 2 (ours, MPI launcher)"
POOL_RESTART = "Pool.restart() on 2 hosts x 2 (ours, ssh, forkers kept)"
TORCHRUN_READY = "torchrun --nnodes 2 to a ready group"
TORCHRUN_TOTAL = "torchrun --nnodes 2 relaunch, launch to exit"
POOL_RUN = "Pool.run('pass') on 2 hosts x 2 (ours)"


def host_set():
    """The simulated hosts named by ``FSDPI_TESTHOSTS`` (``None`` when they are not up)."""
    from tests.multihost.testhosts import HostSet

    state = os.environ.get("FSDPI_TESTHOSTS")
    if not state or not HostSet(state).is_up:
        return None
    hosts = HostSet(state)
    return hosts if len(hosts.hosts) >= HOSTS else None


def _pool(hosts, profile_dir: str, launcher: str = "ssh"):
    from fsdp_interactive.pool import Pool
    from tests.multihost.launchers import mpi_pool_kwargs, ssh_pool_kwargs

    kwargs = (ssh_pool_kwargs if launcher == "ssh" else mpi_pool_kwargs)(
        hosts, PER_HOST, profile_dir
    )
    return Pool(HOSTS * PER_HOST, devices="cpu", timeout=240, show_topology=False, **kwargs)


def pool_start_seconds(hosts, profile_dir: str, launcher: str = "ssh") -> float:
    pool = _pool(hosts, profile_dir, launcher)
    try:
        began = time.perf_counter()
        pool.start()
        return time.perf_counter() - began
    finally:
        pool.stop()


def torchrun_two_hosts(hosts, timeout: float = 180.0) -> Relaunch:
    """One torchrun launcher per host, c10d rendezvous on the first host's address."""
    head = hosts.hosts[0]
    endpoint = f"{head.address}:{29400 + secrets.randbelow(500)}"
    run_id = secrets.token_hex(4)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", BENCH_BACKEND="gloo")
    start_wall = time.time()
    began = time.perf_counter()
    procs = [
        subprocess.Popen(
            hosts.enter_command(
                host.name,
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    f"--nnodes={HOSTS}",
                    f"--nproc-per-node={PER_HOST}",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={endpoint}",
                    f"--rdzv-id={run_id}",
                    f"--node-rank={index}",
                    str(NOOP_SCRIPT),
                ],
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for index, host in enumerate(hosts.hosts[:HOSTS])
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
    total = time.perf_counter() - began
    for proc, (_, err) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{err[-3000:]}")
    ready = [line for out, _ in outputs for line in out.splitlines() if line.startswith("READY ")]
    if not ready:
        raise RuntimeError("torchrun's rank 0 never printed READY")
    return Relaunch(ready_s=float(ready[0].split()[1]) - start_wall, total_s=total)


def run(settings: Settings) -> FigureResult:
    """Pool.start() and Pool.run('pass') at 2 hosts x 2 ranks vs torchrun --nnodes 2."""
    hosts = host_set()
    if hosts is None:
        return _measure(settings, None)
    from tests.multihost.testhosts import environ_set

    # mpiexec runs with this process's environment; it is restored afterwards.
    with environ_set(hosts.mpi_env):
        return _measure(settings, hosts)


def _measure(settings: Settings, hosts) -> FigureResult:
    result = FigureResult("multihost", "Two hosts x two ranks (simulated hosts)")
    unavailable = missing("fsdp_interactive.pool", "Pool") or (
        None
        if hosts is not None
        else "needs the simulated hosts up and FSDPI_TESTHOSTS=DIR "
        "(python -m tests.multihost.testhosts --state DIR up, as root)"
    )
    if unavailable:
        result.error = unavailable
        return result
    reps = 1 if settings.quick else 5
    profile_dir = str(Path(hosts.state_dir) / f"bench-profile-{os.getpid()}")
    samples: dict[str, list[float]] = {
        POOL_START: [],
        MPI_START: [],
        TORCHRUN_READY: [],
        TORCHRUN_TOTAL: [],
    }
    contenders = ["ssh", "mpi", "torchrun"]
    for index in range(reps):
        for name in rotated(contenders, index):
            if name == "ssh":
                samples[POOL_START].append(pool_start_seconds(hosts, profile_dir))
            elif name == "mpi":
                samples[MPI_START].append(pool_start_seconds(hosts, profile_dir, "mpi"))
            else:
                relaunch = torchrun_two_hosts(hosts)
                samples[TORCHRUN_READY].append(relaunch.ready_s)
                samples[TORCHRUN_TOTAL].append(relaunch.total_s)
        print(f"round {index + 1}/{reps} done", file=sys.stderr, flush=True)
    stats = {name: Stat(values, "s") for name, values in samples.items()}
    pool = _pool(hosts, profile_dir)
    try:
        pool.start()
        stats[POOL_RESTART] = measure(pool.restart, reps=reps, warmup=0)
        stats[POOL_RUN] = measure(
            lambda: pool.run("pass", stream=False),
            reps=settings.reps * 3,
            warmup=settings.warmup,
        )
    finally:
        pool.stop()
    result.measurements.update(stats)
    result.notes.append(
        f"{reps} start sample(s) per contender, rotated; {reps} restart(s) of one ssh pool; "
        f"{settings.reps * 3} Pool.run samples after warm-up. Both hosts are network namespaces of one 2-core machine "
        "shared with other work: the figures compare, they do not predict a real cluster."
    )
    case = "2 hosts x 2 ranks"
    for subject, reference, note, target, inverse in (
        (POOL_START, TORCHRUN_READY, "start to a ready group", Target("<=", 1.0), False),
        (MPI_START, TORCHRUN_READY, "start, MPI launcher (no target)", None, False),
        (POOL_RESTART, TORCHRUN_READY, "restart from kept forkers (no target)", None, False),
        (POOL_RUN, TORCHRUN_TOTAL, "how many times faster than a relaunch", None, True),
    ):
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=case,
                subject_name=subject,
                reference_name=reference,
                subject=stats[subject],
                reference=stats[reference],
                target=target,
                inverse=inverse,
                note=note,
                paired=subject in (POOL_START, MPI_START),
            )
        )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
