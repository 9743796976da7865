"""When, where and with what a benchmark run happened: the machine, the versions, the
time and the load average, recorded beside every figure so that numbers from different
runs are never compared blind."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunInfo:
    """When, where and with what a run happened."""

    started: str
    finished: str
    quick: bool
    command: str
    machine: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    load_before: str = ""
    load_after: str = ""

    @classmethod
    def collect(cls, quick: bool, command: str) -> RunInfo:
        return cls(
            started=_now(),
            finished="",
            quick=quick,
            command=command,
            machine=machine_description(),
            versions=versions(),
            load_before=_load(),
        )

    def finish(self) -> None:
        self.finished = _now()
        self.load_after = _load()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def now_and_load() -> str:
    """ "2026-12-03 13:10:04 UTC (load average 1.52 1.61 2.03)": when, and how busy."""
    return f"{_now()} (load average {_load()})"


def _load() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "unknown"


def machine_description() -> dict[str, str]:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical cores": str(os.cpu_count()),
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "gpu": "none (CPU ranks, gloo)",
    }


def versions() -> dict[str, str]:
    import ipyparallel
    import torch

    import fsdp_interactive

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "fsdp_interactive", "bench"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if dirty:
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ipyparallel": ipyparallel.__version__,
        "fsdp_interactive": f"{fsdp_interactive.__version__}, commit {commit}",
    }
