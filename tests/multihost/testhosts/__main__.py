"""``python -m tests.multihost.testhosts``: install, up, status, run, down."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from tests.multihost.testhosts._hostset import HostSet
from tests.multihost.testhosts._system import DEFAULT_STATE
from tests.multihost.testhosts._tools import install_tools


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.multihost.testhosts")
    parser.add_argument("--state", default=os.environ.get("FSDPI_TESTHOSTS", DEFAULT_STATE))
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="apt-get install the tools the hosts need")
    up = commands.add_parser("up", help="bring the hosts up")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--no-slurm", action="store_true")
    commands.add_parser("down", help="end everything the set started; idempotent")
    commands.add_parser("status", help="print the recorded state as JSON")
    run = commands.add_parser("run", help="run a command on a host")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    if args.command == "install":
        install_tools()
        return 0
    hosts = HostSet(args.state)
    if args.command == "up":
        started = time.monotonic()
        hosts.up(args.hosts, slurm=not args.no_slurm)
        print(
            f"up in {time.monotonic() - started:.1f}s: "
            + ", ".join(f"{h.name}={h.address}" for h in hosts.hosts)
            + f", head={hosts.head_address}; ssh -F {hosts.ssh_config} {hosts.hosts[0].name}"
        )
    elif args.command == "down":
        print(json.dumps(hosts.down()))
    elif args.command == "status":
        print(json.dumps(hosts.status(), indent=1))
    elif args.command == "run":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.call(hosts.enter_command(args.host, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
