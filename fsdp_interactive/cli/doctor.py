"""``fsdp-interactive doctor``: is this machine ready for an interactive FSDP session?

Reports Python, torch (and how it was built), the visible CUDA devices, the available
``torch.distributed`` backends and ipyparallel, then runs a smoke test: a 2-rank pool
is started, an ``all_reduce`` is checked on every rank and the pool is stopped. Exit
status 0 when every check passes, 1 otherwise.

This process never initialises CUDA: devices are counted in a subprocess
(:func:`fsdp_interactive.pool.visible_cuda_device_count`) and named by ``nvidia-smi``
when it is installed. Not done: NCCL smoke test unless ``--backend nccl`` is asked for.

``--hosts hosta,hostb`` checks other hosts instead of this machine's own ranks: each
host answers over ssh and its Python (``--remote-python``, default: this interpreter's
path) has this kernel's torch, fsdp_interactive and Python minor version (one line per
host, both versions named); then a pool of one rank per host, started over ssh with the
controller on ``--controller-ip`` (an address of this host the others reach), runs a
gloo ``all_reduce`` across them. ``--ssh-config`` is handed to ssh and scp (``-F``);
``--profile-dir`` must be a directory every host sees at the same path.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="check torch, devices, backends, ipyparallel and run a 2-rank smoke test",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--ranks", type=int, default=2, help="ranks for the smoke test (default: 2)"
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="backend of the smoke test: gloo on CPU (default) or nccl on CUDA devices",
    )
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds allowed for the smoke test pool"
    )
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke test")
    parser.add_argument(
        "--hosts",
        help="comma-separated ssh hosts to check (reachability, versions, a cross-host "
        "all_reduce) instead of local ranks",
    )
    parser.add_argument(
        "--controller-ip", help="with --hosts: this host's address that the hosts reach"
    )
    parser.add_argument("--ssh-config", help="with --hosts: ssh configuration file (ssh -F)")
    parser.add_argument(
        "--remote-python",
        default=sys.executable,
        help="with --hosts: the Python on the hosts (default: this interpreter's path)",
    )
    parser.add_argument(
        "--profile-dir",
        help="with --hosts: ipyparallel profile directory every host sees at the same path",
    )
    return parser


def _check(label: str, fn: Callable[[], str]) -> bool:
    try:
        detail = fn()
    except Exception as exc:
        print(f"[FAIL] {label}: {type(exc).__name__}: {exc}")
        return False
    print(f"[ ok ] {label}: {detail}")
    return True


def _torch() -> str:
    import torch

    build = (
        f"CUDA {torch.version.cuda}"
        if torch.version.cuda
        else (f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU only")
    )
    return f"{torch.__version__} ({build})"


def _devices() -> str:
    from fsdp_interactive.pool import visible_cuda_device_count

    count = visible_cuda_device_count()
    if count == 0:
        return "no CUDA devices visible; CPU ranks (gloo) will be used"
    names = ""
    if shutil.which("nvidia-smi"):
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode == 0:
            names = "; " + "; ".join(line.strip() for line in result.stdout.splitlines())
    return f"{count} CUDA device(s) visible{names}"


def _backends() -> str:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    found = [
        name
        for name, available in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if available
    ]
    if "gloo" not in found:
        raise RuntimeError(f"gloo backend missing (available: {found})")
    return ", ".join(found)


def _ipyparallel() -> str:
    import ipyparallel

    return ipyparallel.__version__


def _smoke(ranks: int, backend: str, timeout: float) -> str:
    from fsdp_interactive.pool import Pool

    started = time.monotonic()
    devices = "cpu" if backend == "gloo" else None
    with Pool(n=ranks, devices=devices, backend=backend, timeout=timeout) as pool:
        up = time.monotonic() - started
        sums = pool.call(_all_reduce_rank_plus_one, timeout=timeout)
    expected = ranks * (ranks + 1) / 2
    if any(value != expected for value in sums):
        raise RuntimeError(f"all_reduce gave {sums}, expected {expected} on every rank")
    total = time.monotonic() - started
    return f"{ranks} ranks up in {up:.1f}s, all_reduce correct, stopped ({total:.1f}s in all)"


def _all_reduce_rank_plus_one() -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value)
    return float(value.item())


def _ssh_config(args: argparse.Namespace, hosts: list[str]) -> Any:
    from traitlets.config import Config

    ssh_args = ["-F", args.ssh_config] if args.ssh_config else []
    section: dict[str, Any] = {
        "engines": {host: 1 for host in hosts},
        "remote_python": args.remote_python,
        "ssh_args": ssh_args,
        "scp_args": list(ssh_args),
    }
    if args.profile_dir:
        section["remote_profile_dir"] = args.profile_dir
    return Config({"SSHEngineSetLauncher": section})


def _hosts_answer(config: Any) -> str:
    from fsdp_interactive.pool import check_ssh_hosts

    check_ssh_hosts(config)
    return "every host answered over ssh with this kernel's versions"


def _hosts_smoke(args: argparse.Namespace, hosts: list[str], config: Any) -> str:
    from fsdp_interactive.pool import Pool

    started = time.monotonic()
    kwargs: dict[str, Any] = {"controller_ip": args.controller_ip, "config": config}
    if args.profile_dir:
        kwargs["profile_dir"] = args.profile_dir
    pool = Pool(
        len(hosts), devices="cpu", engines="ssh", timeout=args.timeout, show_topology=False,
        **kwargs,
    )  # fmt: skip
    with pool:
        up = time.monotonic() - started
        seen = sorted({record.host for record in pool.topology})
        sums = pool.call(_all_reduce_rank_plus_one, timeout=args.timeout)
    n = len(hosts)
    expected = n * (n + 1) / 2
    if any(value != expected for value in sums):
        raise RuntimeError(f"all_reduce gave {sums}, expected {expected} on every rank")
    return (
        f"{n} ranks on {', '.join(seen)} up in {up:.1f}s, all_reduce across them correct, "
        f"stopped ({time.monotonic() - started:.1f}s in all)"
    )


def run_hosts(args: argparse.Namespace) -> int:
    hosts = [host.strip() for host in args.hosts.split(",") if host.strip()]
    if not hosts:
        print("--hosts must name at least one host, e.g. --hosts hosta,hostb", file=sys.stderr)
        return 2
    if not args.controller_ip:
        print(
            "--hosts needs --controller-ip: an address of this host that the hosts reach",
            file=sys.stderr,
        )
        return 2
    print(f"python {platform.python_version()} ({sys.executable}); hosts: {', '.join(hosts)}")
    config = _ssh_config(args, hosts)
    results = [_check("torch", _torch), _check("hosts", lambda: _hosts_answer(config))]
    if results[-1] and not args.no_smoke:
        results.append(
            _check("cross-host all_reduce (gloo)", lambda: _hosts_smoke(args, hosts, config))
        )
    ok = all(results)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    if args.hosts is not None:
        return run_hosts(args)
    if args.ranks < 1:
        print(f"--ranks must be >= 1, got {args.ranks}", file=sys.stderr)
        return 2
    print(f"python {platform.python_version()} ({sys.executable})")
    results = [
        _check("torch", _torch),
        _check("devices", _devices),
        _check("backends", _backends),
        _check("ipyparallel", _ipyparallel),
    ]
    if not args.no_smoke:
        results.append(
            _check(
                f"smoke test ({args.backend})",
                lambda: _smoke(args.ranks, args.backend, args.timeout),
            )
        )
    ok = all(results)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
