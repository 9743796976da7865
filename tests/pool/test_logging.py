"""Log records: silent by default; a log level shows the start-up phases and the ranks' records."""

from __future__ import annotations

import logging

import pytest

from fsdp_interactive.pool import Pool
from fsdp_interactive.pool.common._logs import ENV_VAR, parse_level
from tests.pool.conftest import record, run_script_streams

PHASES = (
    "fsdp_interactive.pool.processes._launched: controller up in ",
    "fsdp_interactive.pool.processes._launched: 2 engines started (forked by this host pid ",
    "fsdp_interactive.pool._registration: 2 engines registered in ",
    "fsdp_interactive.pool._rendezvous: describing engines took ",
    "fsdp_interactive.pool._rendezvous: opening the rendezvous store took ",
    "fsdp_interactive.pool._rendezvous: forming the process group took ",
    "fsdp_interactive.pool._pool: running: 2 ranks, started in ",
    "fsdp_interactive.pool.processes._launched: engines stopped in ",
    "fsdp_interactive.pool.processes._launched: controller stopped in ",
    "fsdp_interactive.pool.processes._host_forkers: engine forker for this host (pid ",
)

API_SCRIPT = """
import sys
from fsdp_interactive.pool import Pool
pool = Pool(n=2, devices="cpu", profile_dir=sys.argv[1], show_topology=False, log_level="debug")
pool.start()
pool.run("import logging\\nlogging.getLogger('fsdp_interactive.probe').debug('hello from %d', rank)")
pool.stop()
"""


def test_debug_level_shows_start_up_phases_and_rank_records(profile_dir):
    _, err = run_script_streams(API_SCRIPT, profile_dir)
    missing = [phase for phase in PHASES if phase not in err]
    assert not missing, f"phases not logged: {missing}\n{err}"
    for rank in (0, 1):
        # the ranks' own records: during start-up and from code run later
        joined = f"DEBUG fsdp_interactive.pool.rank._bootstrap: rank {rank} joined in"
        assert f"[rank {rank}:stderr] {joined}" in err
        assert f"[rank {rank}:stderr] DEBUG fsdp_interactive.probe: hello from {rank}\n" in err


MAGIC_SCRIPT = """
import sys
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython
shell = start_ipython()
shell.run_line_magic("load_ext", "fsdp_interactive")
try:
    shell.run_line_magic("fsdp", "start -n 1 --backend gloo --log-level loud")
except UsageError as error:
    print("refused:", error)
shell.run_line_magic("fsdp", "start -n 1 --backend gloo --log-level debug")
shell.run_line_magic("fsdp", "stop")
"""


def test_fsdp_start_log_level_option_turns_records_on(profile_dir):
    out, err = run_script_streams(MAGIC_SCRIPT, env={"IPYTHONDIR": profile_dir})
    assert "refused:" in out and "--log-level" in out and "'loud'" in out
    assert "fsdp_interactive.pool._pool: running: 1 ranks, started in " in err
    assert "[rank 0:stderr] DEBUG fsdp_interactive.pool.rank._bootstrap: rank 0 joined in" in err


def test_ranks_records_are_not_shown_by_default(pool: Pool, capsys):
    pool.run(
        "import logging\n"
        "logging.getLogger('fsdp_interactive.probe').debug('debug record')\n"
        "logging.getLogger('fsdp_interactive.probe').info('info record')"
    )
    out, err = capsys.readouterr()
    assert "record" not in out + err


@pytest.mark.parametrize(
    ("value", "level"),
    [("debug", logging.DEBUG), ("INFO", logging.INFO), (" warning ", logging.WARNING), (5, 5)],
)
def test_log_levels_are_names_or_numbers(value, level):
    assert parse_level(value) == level
    assert Pool(log_level=value)._log_level == level


@pytest.mark.parametrize("value", ["loud", "", True, -1, 2.5])
def test_bad_log_level_names_the_argument(value):
    with pytest.raises(ValueError, match="log_level must be a logging level name"):
        Pool(log_level=value)


def test_environment_variable_sets_the_default_level(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "debug")
    assert Pool()._log_level == logging.DEBUG
    assert Pool(log_level="info")._log_level == logging.INFO  # the argument wins
    monkeypatch.setenv(ENV_VAR, "chatty")
    with pytest.raises(ValueError, match=f"{ENV_VAR} must be a logging level name"):
        Pool()


def test_start_reports_starting_until_the_group_is_up(pool: Pool):
    """While the namespaces are set up the pool is starting, not running."""
    seen: list[tuple[str, str, bool]] = []

    class Watch(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            seen.append((rec.getMessage(), pool.state, pool.running))

    logger = logging.getLogger("fsdp_interactive.pool._rendezvous")
    handler, level = Watch(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        pool.restart()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        record(pool)
    assert any(message.startswith("setting up the rank namespaces") for message, _, _ in seen)
    assert {(state, running) for _, state, running in seen} == {("starting", False)}
    assert pool.state == "running" and pool.running
