"""Make a training job attachable from a notebook: ``%fsdp attach`` reaches its ranks.

Either run the script unmodified under this module, on every rank::

    torchrun --nproc-per-node 2 -m fsdp_interactive.attachable [--attach-dir DIR] \\
        [--pause-timeout S] [--listen ADDRESS] [--job-name NAME] train.py ARGS

(``srun ... python -m fsdp_interactive.attachable train.py`` under SLURM), or call
``fsdp_interactive.attachable()`` in the script, best before ``init_process_group``.

Every rank then writes a connection record (with a fresh key, in a private folder:
:mod:`fsdp_interactive._attach_records`) and serves a notebook of the same user
(:mod:`fsdp_interactive.pool.rank._attach_service`): status and stacks at any time,
collectives from torch's flight recorder, and a pause after an optimizer step in which
cells, views, snapshots and checkpoints run on the job's ranks. While no notebook is
attached the job pays one Python call per optimizer step; it computes exactly what it
computes without this module, and a job that was attached and detached ends with the same
parameters, bit for bit. ``--listen`` adds a TCP listener on that address for notebooks
on other hosts that cannot reach the ranks over ssh; by default nothing listens beyond a
Unix socket in the private folder.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import threading
import types
from typing import Any

from fsdp_interactive.pool.rank import _attach_service
from fsdp_interactive.pool.rank._attach_service import DEFAULT_PAUSE_TIMEOUT_S, AttachOptions


def attachable(
    *,
    attach_dir: str | os.PathLike | None = None,
    job_name: str | None = None,
    pause_timeout: float = DEFAULT_PAUSE_TIMEOUT_S,
    listen: str | None = None,
) -> Any:
    """Make this rank attachable (once per process; later calls return the same service).

    ``attach_dir``: where the job's records go (default ``$FSDPI_ATTACH_DIR``, else under
    ``$XDG_RUNTIME_DIR``, else the temporary folder; made private, mode 0700);
    ``job_name``: the job's folder there (default: from SLURM's or torchrun's
    environment); ``pause_timeout``: seconds a paused rank waits for a notebook that went
    away before it resumes by itself (at most a day); ``listen``: also listen on TCP at
    this address (for notebooks on other hosts without ssh to this one). Returns the
    rank's service; ``.record`` says where it listens.
    """
    options = AttachOptions(
        attach_dir=None if attach_dir is None else os.fspath(attach_dir),
        job=job_name,
        listen=listen,
        pause_timeout=pause_timeout,
    )
    return _attach_service.start(options)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_interactive.attachable",
        description="run a training script with its rank attachable from a notebook",
    )
    parser.add_argument("--attach-dir", default=None, help="folder for the job's records")
    parser.add_argument("--job-name", default=None, help="the job's name there")
    parser.add_argument(
        "--pause-timeout",
        type=float,
        default=DEFAULT_PAUSE_TIMEOUT_S,
        help="seconds a pause outlives a notebook that went away (default 300)",
    )
    parser.add_argument("--listen", default=None, help="also listen on TCP at this address")
    parser.add_argument("-m", dest="module", default=None, help="run a module, as python -m")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def main(argv: list[str] | None = None) -> None:
    """``python -m fsdp_interactive.attachable [options] script.py ARGS`` (or ``-m MODULE``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.script is None and args.module is None:
        parser.error("name the training script (train.py ARGS) or a module (-m MODULE ARGS)")
    target = args.module or args.script
    rest = list(args.args)
    if args.module is not None and args.script is not None:
        rest.insert(0, args.script)  # -m MODULE ARGS: the first argument parsed as a script
    try:
        _attach_service.start(
            AttachOptions(
                attach_dir=args.attach_dir,
                job=args.job_name,
                listen=args.listen,
                pause_timeout=args.pause_timeout,
            ),
            training_thread=threading.main_thread().ident,
        )
    except (ValueError, OSError) as error:
        parser.error(str(error))
    sys.argv = [target, *rest]
    if args.module is not None:
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return
    sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python train.py` has it
    runpy.run_path(target, run_name="__main__")


class _CallableModule(types.ModuleType):
    """``fsdp_interactive.attachable(...)`` works whether the package's attribute is this
    function or this module (after ``import fsdp_interactive.attachable``)."""

    def __call__(self, **kwargs: Any) -> Any:
        return attachable(**kwargs)


if __name__ != "__main__":
    sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
