"""Run the tests whose outcome depends on timing, N rounds, beside a CPU hog; print each
test's failures out of N, and the pool starts that failed out of those made.

``python -m tests.stress [--rounds N] [--hog K] [--out DIR] [--starts S] [--sizes 4,8]
[--no-tests] [-- PYTEST ARGS]`` (``make test-stress``, ``STRESS_ROUNDS=10``,
``STRESS_STARTS=5``). Each round runs the tests, then the start loop
(:mod:`tests.start_loop`: ``S`` starts and stops of each size, cold and from a forker with
warm imports; ``--starts 0`` leaves it out, ``--no-tests`` runs it alone). The tests are
those marked ``timing`` (streamed output and progress bars in a kernel and in the
browser, death and hang detection, breakpoints and post-mortem, interrupts, snapshots and
recovery under faults, multi-host faults). While the rounds run, K busy loops (default: twice the machine's cores) compete
for the CPU; they are started here and ended here, by their handles, also when the run
is interrupted. Each round is one pytest run writing a JUnit XML report into ``DIR``
(default ``out/stress``); the outcomes are read from those reports, never from pytest's
text. The load average is recorded at the start and end of every round, so a record says
how busy the machine was. Exit status 1 when any test or any start failed in any round.

A test skipped in a round is counted as such, not as passed: a run whose browser or
multi-host tests were skipped says so in its table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
MARKER = "timing"
STOP_GRACE_S = 180.0


@dataclass
class Round:
    """One pytest run: its outcome per test id ("passed", "failed", "skipped"); and the
    start loop's counts that followed it (:mod:`tests.start_loop`, one dict per size and
    kind)."""

    number: int
    seconds: float
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    exit_code: int
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    starts: list[dict] = field(default_factory=list)


def case_id(case: ET.Element) -> str:
    """``tests/pool/test_x.py::test_y[param]`` from a JUnit ``testcase`` element."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = [part for part in classname.split(".") if part]
    # pytest writes "tests.pool.test_x" (or "tests.pool.test_x.TestClass")
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (REPO / path).is_file():
            return "::".join([path.as_posix(), *parts[cut:], name])
    return f"{classname}::{name}"


def read_report(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Outcome and (for failures) first message line of every test case in a JUnit report."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = case_id(case)
        failed = case.find("failure")
        if failed is None:
            failed = case.find("error")
        if failed is not None:
            outcomes[key] = "failed"
            lines = (failed.get("message") or "").strip().splitlines()
            messages[key] = lines[0][:300] if lines else "(no message)"
        elif case.find("skipped") is not None:
            outcomes[key] = "skipped"
        else:
            outcomes[key] = "passed"
    return outcomes, messages


@contextmanager
def cpu_hog(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` busy processes for the duration of the block, ended by their handles."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def marked_files(pytest_args: list[str]) -> list[str]:
    """The test files that hold tests marked ``timing`` (collected once, so that each round
    imports only those)."""
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            MARKER,
            "-p",
            "no:cacheprovider",
            *pytest_args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    files = sorted({line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line})
    if not files:
        raise SystemExit(
            f"no test marked {MARKER!r} was collected:\n{listed.stdout}{listed.stderr}"
        )
    return files


@contextmanager
def simulated_hosts(files: list[str], state: Path) -> Iterator[None]:
    """The multi-host tests' hosts, brought up once for every round (each pytest run would
    otherwise bring them up and down itself) and down at the end; nothing when no
    multi-host test is selected, ``FSDPI_TESTHOSTS`` names hosts already, or the hosts
    cannot run here (the tests then skip, or fail under ``FSDPI_REQUIRE_MULTIHOST=1``)."""
    if not any(f.startswith("tests/multihost/") for f in files) or os.environ.get(
        "FSDPI_TESTHOSTS"
    ):
        yield
        return
    from tests.multihost.testhosts import HostSet, HostSetError, missing_tools

    if os.geteuid() != 0 or missing_tools():
        yield
        return
    hosts = HostSet(state)
    try:
        hosts.up(2)
    except HostSetError as error:
        print(f"the simulated hosts could not be brought up ({error}); each round tries again")
        yield
        return
    os.environ["FSDPI_TESTHOSTS"] = str(state)
    try:
        yield
    finally:
        del os.environ["FSDPI_TESTHOSTS"]
        hosts.down()


def run_to_the_end(command: list[str], log: IO[str], *, own_session: bool = True) -> int:
    """Run pytest (or the start loop); when this runner is told to stop (SIGINT, SIGTERM),
    it is interrupted as by Ctrl-C, so that its fixtures stop the pools and hosts they
    started, and waited for (killed only if it does not end within ``STOP_GRACE_S``).
    ``own_session=False`` runs it in this runner's session, with the hog (see
    :func:`run_start_loop`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the log shows each test as it ends
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=own_session,
    )
    try:
        return proc.wait()
    except BaseException:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def run_round(number: int, out: Path, pytest_args: list[str]) -> Round:
    report = out / f"round-{number:02d}.xml"
    load_start = os.getloadavg()
    began = time.monotonic()
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        MARKER,
        "-v",
        "--durations=0",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        *pytest_args,
    ]
    with open(out / f"round-{number:02d}.log", "w") as log:
        code = run_to_the_end(command, log)
    outcomes, messages = read_report(report) if report.exists() else ({}, {})
    return Round(
        number,
        time.monotonic() - began,
        load_start,
        os.getloadavg(),
        code,
        outcomes,
        messages,
    )


def run_start_loop(
    number: int, out: Path, starts: int, sizes: str, timeout: float = 120.0
) -> list[dict]:
    """The start loop of round ``number`` (its output in ``round-NN-starts.log``); its
    counts, or ``[]`` when it did not run through.

    The loop runs in this runner's session, beside the hog: Linux's autogroup scheduler
    shares a session's CPU among its processes, so the loop's kernel competes with the
    busy processes as a notebook kernel competes with what its own session runs (and the
    engines, each in a session of their own, do not). In a session of its own the kernel
    would get a full share, and the start's races under load would not show (the code
    that lost engines failed 0 of 40 starts there, 2 of 40 in the hog's session).
    """
    counts = out / f"round-{number:02d}-starts.json"
    command = [
        sys.executable,
        "-m",
        "tests.start_loop",
        "--starts",
        str(starts),
        "--sizes",
        sizes,
        "--timeout",
        f"{timeout:g}",
        "--json",
        str(counts),
    ]
    with open(out / f"round-{number:02d}-starts.log", "w") as log:
        code = run_to_the_end(command, log, own_session=False)
    if code != 0 or not counts.exists():
        return []
    return json.loads(counts.read_text())


def start_table(rounds: list[Round]) -> str:
    """Failed starts out of the starts made, per size and kind, over every round."""
    totals: dict[tuple[int, str], list[int]] = {}
    for done in rounds:
        for count in done.starts:
            total = totals.setdefault((count["size"], count["kind"]), [0, 0, 0, 0])
            total[0] += len(count["failures"])
            total[1] += count["starts"]
            total[2] += len(count.get("retries", []))
            total[3] += count.get("missed", 0)
    return "\n".join(
        f"{size} ranks, {kind}: {failed}/{made} starts failed, {retried} engine(s) retried, "
        f"{missed} client(s) replaced for missed registrations"
        for (size, kind), (failed, made, retried, missed) in sorted(totals.items())
    )


def table(rounds: list[Round]) -> str:
    """Each test's failures (and skips) out of the rounds, failures first."""
    tests = sorted({key for r in rounds for key in r.outcomes})
    n = len(rounds)
    rows = []
    for key in tests:
        failed = sum(r.outcomes.get(key) == "failed" for r in rounds)
        skipped = sum(r.outcomes.get(key) == "skipped" for r in rounds)
        missing = sum(key not in r.outcomes for r in rounds)
        note = f", skipped {skipped}/{n}" if skipped else ""
        note += f", not run {missing}/{n}" if missing else ""
        rows.append((-failed, key, f"{failed}/{n} failed{note}"))
    width = max((len(key) for _, key, _ in rows), default=10)
    return "\n".join(f"{key:<{width}}  {text}" for _, key, text in sorted(rows))


def _load(values: tuple[float, float, float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress", description=__doc__)
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("STRESS_ROUNDS", 5)))
    parser.add_argument(
        "--hog",
        type=int,
        default=2 * (os.cpu_count() or 1),
        help="busy processes beside the tests (default: twice the cores)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "out" / "stress")
    parser.add_argument(
        "--starts",
        type=int,
        default=int(os.environ.get("STRESS_STARTS", 5)),
        help="pool starts per size and kind in each round's start loop (0: none)",
    )
    parser.add_argument("--sizes", default="4,8", help="ranks per start in the start loop")
    parser.add_argument(
        "--start-timeout", type=float, default=120.0, help="each start's timeout in the loop"
    )
    parser.add_argument(
        "--no-tests", action="store_true", help="run the start loop only, no pytest rounds"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.starts < 0:
        parser.error(f"--starts must be 0 or more, got {args.starts}")
    if args.no_tests and not args.starts:
        parser.error("--no-tests runs the start loop only: give --starts 1 or more")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.hog < 0:
        parser.error(f"--hog must be 0 or more busy processes, got {args.hog}")
    args.out.mkdir(parents=True, exist_ok=True)
    # A `kill` of this runner interrupts pytest and ends the hog (see run_to_the_end).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds: list[Round] = []
    tests = "no tests" if args.no_tests else f"`pytest -m {MARKER}`"
    loop = (
        f", then {args.starts} starts of {args.sizes} ranks, cold and warm," if args.starts else ""
    )
    print(
        f"{args.rounds} rounds of {tests}{loop} beside {args.hog} busy processes "
        f"on {os.cpu_count()} cores; reports in {args.out}",
        flush=True,
    )
    files = [] if args.no_tests else marked_files(args.pytest_args)
    selected = [*files, *args.pytest_args]
    with simulated_hosts(files, args.out / "hosts"), cpu_hog(args.hog):
        for number in range(1, args.rounds + 1):
            if args.no_tests:
                load = os.getloadavg()
                done = Round(number, 0.0, load, load, 0)
            else:
                done = run_round(number, args.out, selected)
            rounds.append(done)
            failed = [k for k, v in done.outcomes.items() if v == "failed"]
            if not args.no_tests:
                print(
                    f"round {number}: {len(done.outcomes) - len(failed)} ok, {len(failed)} "
                    f"failed in {done.seconds:.0f} s; load {_load(done.load_start)} -> "
                    f"{_load(done.load_end)} (pytest exit {done.exit_code})",
                    flush=True,
                )
            for key in failed:
                print(f"  FAILED {key}: {done.messages.get(key, '')}", flush=True)
            if args.starts:
                began, load = time.monotonic(), os.getloadavg()
                done.starts = run_start_loop(
                    number, args.out, args.starts, args.sizes, args.start_timeout
                )
                done.load_end = os.getloadavg()
                print(
                    f"round {number} start loop in {time.monotonic() - began:.0f} s; load "
                    f"{_load(load)} -> {_load(done.load_end)}:\n  "
                    + (start_table([done]).replace("\n", "\n  ") or "did not run through"),
                    flush=True,
                )
    if not args.no_tests:
        print("\nfailures out of rounds:\n" + table(rounds))
    if args.starts:
        print("\nfailed starts out of starts made:\n" + start_table(rounds))
    summary = {
        "rounds": len(rounds),
        "hog": args.hog,
        "cores": os.cpu_count(),
        "per_round": [
            {
                "round": r.number,
                "seconds": round(r.seconds, 1),
                "load_start": r.load_start,
                "load_end": r.load_end,
                "exit_code": r.exit_code,
                "failed": {
                    k: r.messages.get(k, "") for k, v in r.outcomes.items() if v == "failed"
                },
            }
            for r in rounds
        ],
        "failures": {
            key: sum(r.outcomes.get(key) == "failed" for r in rounds)
            for key in sorted({k for r in rounds for k in r.outcomes})
        },
        "starts": [{"round": r.number, "counts": r.starts} for r in rounds],
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    broken = any(
        (not args.no_tests and (r.exit_code not in (0, 1) or not r.outcomes))
        or (args.starts and not r.starts)
        for r in rounds
    )
    if broken:
        print("a round did not run through (see its .log files): the record is incomplete")
    failed_starts = any(c["failures"] for r in rounds for c in r.starts)
    return 1 if broken or failed_starts or any(summary["failures"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
