"""Finding the job a notebook attaches to: its ranks' records, on this host or others.

What the user names (``%fsdp attach [DIR|JOB_ID|NAME]``, ``fsdp_interactive.attach(...)``):

* nothing: the one attachable job of this user on this host (in the default attach dir);
* a folder: a job's folder (it holds ``rank-*.json``), or an attach dir with one job;
* a SLURM job id (digits): the job's nodes from ``squeue``; the records are read on each
  node (over ssh where the node is not this host), from the job's folder
  ``slurm-<id>[.<step>]``;
* a job's name (``torchrun-...``): that folder of the attach dir; with ``hosts``, on each of
  those hosts.

Every rank of the job must be found (``world_size`` records), or the attach is refused
naming the ranks that are missing. Records are read only from private folders of this
user (:mod:`fsdp_interactive._attach_records`); on another host, by the same program run
there over ssh (:func:`pool.processes._ssh_tunnel.remote_records`).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_interactive import _attach_records
from fsdp_interactive._attach_records import AttachRecord
from fsdp_interactive._private_files import NotPrivateError
from fsdp_interactive.pool._attach_errors import AttachError
from fsdp_interactive.pool.processes._ssh_tunnel import remote_records

log = logging.getLogger(__name__)

_START_ONE = (
    "start the job with torchrun ... -m fsdp_interactive.attachable train.py ARGS, or call "
    "fsdp_interactive.attachable() in the script"
)


@dataclass(frozen=True)
class FoundJob:
    """A job's records in rank order; ``remote``: the hosts reached over ssh (record host
    -> ssh destination)."""

    name: str
    records: list[AttachRecord]
    remote: dict[str, str]


def this_host() -> str:
    return socket.gethostname()


def find_job(
    target: str | os.PathLike | None = None,
    *,
    attach_dir: str | os.PathLike | None = None,
    hosts: Sequence[str] | None = None,
    ssh_args: Sequence[str] = (),
    python: str | None = None,
) -> FoundJob:
    """The job ``target`` names (see the module); :class:`AttachError` saying what was
    looked at when there is none, or several, or ranks are missing."""
    python = python or sys.executable
    text = None if target is None else os.fspath(target)
    if hosts is None and text is not None and text.isdigit():
        hosts = slurm_nodes(text)
        text = f"slurm-{text}"
    if hosts:
        return _on_hosts(text, list(hosts), attach_dir, ssh_args, python)
    if text is not None and os.sep in text:
        try:
            os.stat(text)
        except PermissionError as error:
            raise AttachError(
                f"{text}: {error.strerror}; a job's records are readable only by the user who "
                "started it"
            ) from None
        except FileNotFoundError:
            raise AttachError(
                f"{text}: no such folder; name a job's folder, its attach dir or a SLURM job id"
            ) from None
    if text is not None and os.path.isdir(text):
        folder = os.path.abspath(text)
        if any(n.startswith(_attach_records.RECORD_PREFIX) for n in os.listdir(folder)):
            return _complete(os.path.basename(folder), _read_folder(folder), {})
        return _only_job(folder, None)
    return _only_job(_attach_records.attach_dir(attach_dir), text)


def _read_folder(folder: str) -> list[AttachRecord]:
    try:
        return _attach_records.read_job(folder)
    except NotPrivateError as error:
        raise AttachError(
            f"refusing to read attach records from {error.path}: it {error.reason}"
        ) from None
    except PermissionError as error:
        raise AttachError(
            f"{folder}: {error.strerror}; a job's records are readable only by the user who "
            "started it"
        ) from None


def _only_job(base: str, name: str | None) -> FoundJob:
    try:
        jobs = _attach_records.list_jobs(base)
    except NotPrivateError as error:
        raise AttachError(f"refusing the attach dir {error.path}: it {error.reason}") from None
    except PermissionError as error:
        raise AttachError(
            f"{base}: {error.strerror}; a job's records are readable only by the user who "
            "started it"
        ) from None
    if name is not None:
        jobs = {n: r for n, r in jobs.items() if n == name or n.startswith(f"{name}.")}
    if not jobs:
        what = f"no attachable job {name!r}" if name else "no attachable job"
        raise AttachError(f"{what} of this user on {this_host()} (looked in {base}); {_START_ONE}")
    if len(jobs) > 1:
        listed = ", ".join(f"{n} ({len(r)} ranks)" for n, r in sorted(jobs.items()))
        raise AttachError(f"several attachable jobs in {base}: {listed}; name one of them")
    ((job, records),) = jobs.items()
    return _complete(job, records, {})


def _on_hosts(
    name: str | None,
    hosts: list[str],
    attach_dir: str | os.PathLike | None,
    ssh_args: Sequence[str],
    python: str,
) -> FoundJob:
    here = this_host()
    found: dict[str, list[AttachRecord]] = {}
    remote: dict[str, str] = {}
    for host in dict.fromkeys(hosts):
        if host in (here, "localhost"):
            base = _attach_records.attach_dir(attach_dir)
            jobs = _attach_records.list_jobs(base)
            for job, records in jobs.items():
                if name is None or job == name or job.startswith(f"{name}."):
                    found.setdefault(job, []).extend(records)
            continue
        try:
            answer = remote_records(
                host,
                name,
                ssh_args=ssh_args,
                python=python,
                attach_dir=None if attach_dir is None else os.fspath(attach_dir),
            )
        except OSError as error:
            raise AttachError(str(error)) from None
        for job, raw in answer.get("jobs", {}).items():
            records = [AttachRecord.from_json(r, f"{host}:{answer.get('attach_dir')}") for r in raw]
            found.setdefault(job, []).extend(records)
            for record in records:
                remote[record.host] = host
    if not found:
        what = f"job {name!r}" if name else "attachable job"
        raise AttachError(f"no {what} of this user on {', '.join(hosts)}; {_START_ONE}")
    if len(found) > 1:
        raise AttachError(
            f"several jobs match on {', '.join(hosts)}: {', '.join(sorted(found))}; name one"
        )
    ((job, records),) = found.items()
    return _complete(job, records, remote)


def _complete(job: str, records: list[AttachRecord], remote: dict[str, str]) -> FoundJob:
    records = sorted(records, key=lambda r: r.rank)
    if not records:
        raise AttachError(f"job {job}: no rank answers on its socket yet (or any more)")
    world = records[0].world_size
    missing = sorted(set(range(world)) - {r.rank for r in records})
    if missing:
        hosts = sorted({r.host for r in records})
        raise AttachError(
            f"job {job}: ranks {missing} of {world} have no record on {', '.join(hosts)} (not "
            "started yet, ended, or on hosts not looked at: name them with hosts=[...])"
        )
    return FoundJob(job, records, remote)


def slurm_nodes(job_id: str) -> list[str]:
    """The nodes SLURM runs job ``job_id`` on (``squeue``, then ``scontrol show
    hostnames``); :class:`AttachError` when it is not running."""
    listed = _run(["squeue", "-h", "-j", job_id, "-o", "%T %N"])
    line = listed.strip().splitlines()[0] if listed.strip() else ""
    state, _, nodelist = line.partition(" ")
    if state != "RUNNING" or not nodelist:
        raise AttachError(f"SLURM job {job_id} is not running (squeue says {line or 'nothing'!r})")
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise AttachError(f"{argv[0]} failed: {error}") from None
    if done.returncode != 0:
        raise AttachError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout
