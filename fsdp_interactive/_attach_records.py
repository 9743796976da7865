"""Where the ranks of an attachable job can be reached, and with which key: its records.

Every rank of an attachable job (:mod:`fsdp_interactive.attachable`) writes one record,
``rank-<N>.json``, into its job's folder ``<attach dir>/<job>/``, beside the Unix socket
it listens on (``rank-<N>.sock``). The attach dir is, first that applies:
``--attach-dir``/``attach_dir=``, ``$FSDPI_ATTACH_DIR``, ``$XDG_RUNTIME_DIR/fsdpi-attach``
(when the runtime dir is a private folder of this user, as systemd makes it), else
``<temporary dir>/fsdpi-attach-<uid>``. Both folders are private folders
(:mod:`fsdp_interactive._private_files`: mode 0700, this user's, never a link), the
records files of mode 0600 made with ``O_EXCL|O_NOFOLLOW``: only this user (and root)
can read a key or connect to a socket. A record is read back only from such a folder,
without following a link.

A record holds the rank's key (32 random bytes, hex): the notebook proves it holds it in
the handshake of :mod:`fsdp_interactive.pool.common._agent_wire`; it never travels on a
command line. The job's name is ``--job-name``, else ``slurm-<job id>[.<step id>]`` under
SLURM, else ``torchrun-<run id>`` (torchrun's ``--rdzv-id``; ``--standalone`` makes a
fresh one), else ``torchrun-<pid of torchrun's agent>``, else ``pid-<pid>``.

Run as a program, it prints a job's records as JSON on stdout: how a notebook on another
host reads them, over ssh (``python -m fsdp_interactive._attach_records JOB
[--attach-dir DIR]``; no argument lists the jobs). Standard library only, plus the private
files helper: it starts in a fraction of a second on a remote host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdp_interactive import _private_files

DIR_ENV = "FSDPI_ATTACH_DIR"
RUNTIME_DIR_ENV = "XDG_RUNTIME_DIR"
RECORD_PREFIX = "rank-"
_FORMAT = "fsdp-interactive-attach-record"
#: Longest path a Unix socket may have on Linux (``sun_path`` is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class AttachRecord:
    """One rank of an attachable job: how to reach it (``socket``: a Unix socket's path;
    ``address``: ``[host, port]`` when the job listens on TCP as well) and its ``key``
    (hex). ``pause_timeout``: seconds a paused rank waits for a notebook that went away
    before it resumes by itself. ``folder``: where the record was read (not written)."""

    job: str
    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    key: str
    socket: str | None
    address: tuple[str, int] | None
    pause_timeout: float
    python: str
    argv: tuple[str, ...] = ()
    started: float = 0.0
    folder: str = field(default="", compare=False)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("folder")
        return {"format": _FORMAT, **data}

    @classmethod
    def from_json(cls, data: Any, folder: str = "") -> AttachRecord:
        """The record of ``data`` (a parsed file); ``ValueError`` for anything else."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError("not an attach record")
        try:
            address = data.get("address")
            return cls(
                job=str(data["job"]),
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                local_rank=int(data["local_rank"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                key=str(data["key"]),
                socket=None if data.get("socket") is None else str(data["socket"]),
                address=None if address is None else (str(address[0]), int(address[1])),
                pause_timeout=float(data["pause_timeout"]),
                python=str(data["python"]),
                argv=tuple(str(a) for a in data.get("argv", ())),
                started=float(data.get("started", 0.0)),
                folder=folder,
            )
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ValueError(f"an attach record with a missing or bad field: {error}") from None

    @property
    def key_bytes(self) -> bytes:
        return bytes.fromhex(self.key)


def default_attach_dir() -> str:
    """The attach dir when none is given (see the module)."""
    chosen = os.environ.get(DIR_ENV)
    if chosen:
        return os.path.abspath(chosen)
    runtime = os.environ.get(RUNTIME_DIR_ENV)
    if runtime and os.path.isabs(runtime):
        with contextlib.suppress(OSError):
            _private_files.check_private_folder(runtime)
            return os.path.join(runtime, "fsdpi-attach")
    return os.path.join(tempfile.gettempdir(), f"fsdpi-attach-{os.geteuid()}")


def attach_dir(path: str | os.PathLike | None = None) -> str:
    """``path`` (absolute), else :func:`default_attach_dir`."""
    return os.path.abspath(path) if path is not None else default_attach_dir()


def job_name(environ: dict[str, str] | None = None) -> str:
    """This process's job name from its environment (see the module)."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if job:
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{job}.{step}" if step and step.isdigit() else f"slurm-{job}"
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id[:16]}"
    if "LOCAL_RANK" in env and "TORCHELASTIC_RESTART_COUNT" in env:
        return f"torchrun-{os.getppid()}"
    return f"pid-{os.getpid()}"


def check_job_name(name: str) -> str:
    if not _private_files.is_plain_name(name) or name.startswith("."):
        raise ValueError(f"a job name is a plain folder name (no '/', not '.' or '..'): {name!r}")
    return name


def make_job_folder(base: str, job: str) -> str:
    """The job's folder under the attach dir ``base``, both made private folders (or
    adopted when they are private folders of this user already); :class:`NotPrivateError`
    naming the folder when one is not."""
    os.makedirs(os.path.dirname(base), exist_ok=True)
    _private_files.make_private_folder(base, exist_ok=True)
    folder = os.path.join(base, check_job_name(job))
    _private_files.make_private_folder(folder, exist_ok=True)
    return folder


def record_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"{RECORD_PREFIX}{rank}.json")


def socket_path(folder: str, rank: int) -> str:
    """Where rank ``rank`` listens; ``ValueError`` when the path is too long for a socket."""
    path = os.path.join(folder, f"{RECORD_PREFIX}{rank}.sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"the socket path {path!r} is longer than a Unix socket allows "
            f"({MAX_SOCKET_PATH} bytes); choose a shorter --attach-dir"
        )
    return path


def write_record(folder: str, record: AttachRecord) -> str:
    """Write ``record`` into the private folder ``folder`` (a rank's earlier record, left
    by a run that ended without removing it, is replaced); the file's path."""
    _private_files.check_private_folder(folder)
    path = record_path(folder, record.rank)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _private_files.write_new_file(path, json.dumps(record.as_json()).encode(), sync=False)
    return path


def remove_rank(folder: str, rank: int, pid: int) -> None:
    """Remove rank ``rank``'s record and socket from ``folder`` when they are the process
    ``pid``'s (a restarted worker may have written its own since), and the job's folder
    when nothing is left in it."""
    try:
        record = read_record(record_path(folder, rank), folder)
    except (OSError, ValueError):
        record = None
    if record is not None and record.pid == pid:
        for path in (record_path(folder, rank), record.socket):
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(folder)  # only when empty


def read_record(path: str, folder: str) -> AttachRecord:
    """The record in the file ``path`` (a regular file, not followed through a link)."""
    return AttachRecord.from_json(json.loads(_private_files.read_regular(path)), folder)


def answers(record: AttachRecord, timeout: float = 1.0) -> bool:
    """Whether something listens on the record's socket (nothing is sent: a dead rank's
    socket file refuses the connection)."""
    if record.socket is None:
        return True
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(record.socket)
    except OSError:
        return False
    finally:
        sock.close()
    return True


def read_job(folder: str, *, live_only: bool = True) -> list[AttachRecord]:
    """The records of the job folder ``folder``, in rank order; with ``live_only`` those
    whose rank answers on its socket (the others are left by ranks that ended without
    removing them, and are removed). :class:`NotPrivateError` when the folder is not a
    private folder of this user: nothing is read from it."""
    _private_files.check_private_folder(folder)
    records = []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith(RECORD_PREFIX) and name.endswith(".json")):
            continue
        try:
            record = read_record(os.path.join(folder, name), folder)
        except (OSError, ValueError):
            continue
        if live_only and not answers(record):
            remove_rank(folder, record.rank, record.pid)
            continue
        records.append(record)
    return sorted(records, key=lambda r: r.rank)


def list_jobs(base: str) -> dict[str, list[AttachRecord]]:
    """Every job under the attach dir ``base`` with live ranks: ``{job: records}``."""
    try:
        _private_files.check_private_folder(base)
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return {}
    jobs = {}
    for name in names:
        folder = os.path.join(base, name)
        with contextlib.suppress(OSError):
            records = read_job(folder)
            if records:
                jobs[name] = records
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_interactive._attach_records",
        description="print the records of this host's attachable jobs as JSON",
    )
    parser.add_argument("job", nargs="?", help="a job's name, or a prefix of one")
    parser.add_argument("--attach-dir", default=None)
    args = parser.parse_args(argv)
    base = attach_dir(args.attach_dir)
    try:
        jobs = list_jobs(base)
    except _private_files.NotPrivateError as error:
        print(json.dumps({"error": str(error)}))
        return 0
    if args.job is not None:
        jobs = {
            name: records
            for name, records in jobs.items()
            if name == args.job or name.startswith(f"{args.job}.")
        }
    out = {
        "host": socket.gethostname(),
        "attach_dir": base,
        "jobs": {name: [r.as_json() for r in records] for name, records in jobs.items()},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
