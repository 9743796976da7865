"""Training jobs started with torchrun, attachable or not, for the tests of ``attach``.

:class:`TorchrunJob` starts ``tests/pool/attach_train.py`` under ``torchrun --standalone``
(as its own process group, so that ending it ends every rank), plain or under
``-m fsdp_interactive.attachable`` with a job name and attach dir of the test's, waits for
every rank's record (:meth:`TorchrunJob.wait_attachable`) and for the end, and is ended by
:meth:`TorchrunJob.close` also when a test fails. :func:`same_bits` compares the final
parameters two runs saved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from fsdp_interactive import _attach_records

SCRIPT = Path(__file__).with_name("attach_train.py")


class TorchrunJob:
    """One torchrun job of ``nproc`` ranks running the test script with ``args``."""

    def __init__(
        self,
        folder: Path,
        nproc: int,
        *args: str,
        attachable: bool = True,
        name: str = "job",
        pause_timeout: float | None = None,
        attach_dir: Path | None = None,
    ) -> None:
        self.folder = folder
        self.nproc = nproc
        self.name = name
        self.attach_dir = attach_dir or folder / "attach"
        self.log = folder / f"{name}.log"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
        ]
        if attachable:
            command += [
                "-m",
                "fsdp_interactive.attachable",
                "--attach-dir",
                str(self.attach_dir),
                "--job-name",
                name,
            ]
            if pause_timeout is not None:
                command += ["--pause-timeout", str(pause_timeout)]
        command += [str(SCRIPT), *args]
        self.command = command
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def job_folder(self) -> Path:
        return self.attach_dir / self.name

    def start(self) -> TorchrunJob:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait_attachable(self, timeout: float = 120.0) -> list[_attach_records.AttachRecord]:
        """Every rank's record, once all ranks wrote theirs (fails with the job's log when
        it ends first or takes longer)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"the job ended before it was attachable:\n{self.output()}")
            if self.job_folder.is_dir():
                records = _attach_records.read_job(str(self.job_folder))
                if len(records) == self.nproc:
                    return records
            time.sleep(0.2)
        raise AssertionError(
            f"the job's ranks wrote no records within {timeout} s:\n{self.output()}"
        )

    def wait(self, timeout: float = 180.0) -> int:
        assert self.process is not None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the job did not end within {timeout} s:\n{self.output()}"
            ) from None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self) -> None:
        """End the job (every process of its group) if it still runs."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(15)

    def __enter__(self) -> TorchrunJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def same_bits(first: Path, second: Path) -> bool:
    """Whether two saved parameter dicts hold the same names and the same bits."""
    a, b = torch.load(first), torch.load(second)
    return a.keys() == b.keys() and all(
        a[name].dtype == b[name].dtype
        and a[name].shape == b[name].shape
        and torch.equal(a[name].view(torch.int32), b[name].view(torch.int32))
        for name in a
    )
