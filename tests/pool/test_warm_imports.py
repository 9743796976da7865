"""Warm imports: a forker imports what replayable cells import, so that the engines of the
next group (a recovery's, a restart's) start with those modules loaded. Real forkers and
a real pool; the modules are written into a real user site-packages folder."""

from __future__ import annotations

import asyncio
import os
import signal
import sysconfig
import time
from pathlib import Path

import pytest

from fsdp_interactive.pool._cell_imports import import_specs
from fsdp_interactive.pool.processes import _warm_imports
from fsdp_interactive.pool.processes._forked_launcher import EngineForker

from .test_engine_forker import CHILD, Child


def test_import_specs_reads_every_import_of_a_cell_without_running_it():
    source = """
import os.path as p, json
from transformers import GPT2Config, GPT2LMHeadModel
from torch.nn import *
from . import local_helper
%time x = 1
!ls
def train():
    import wave
    from colorsys import rgb_to_hls
import json
"""
    assert import_specs(source) == [
        "os.path",
        "json",
        "transformers:GPT2Config",
        "transformers:GPT2LMHeadModel",
        "torch.nn",
        "wave",
        "colorsys:rgb_to_hls",
    ]
    assert import_specs("def broken(:\n    import json") == []


@pytest.mark.parametrize(
    "specs",
    [["os path"], [".relative"], ["json:"], ["a:b:c"], "json", [3]],
)
def test_bad_import_specs_are_refused_naming_the_form(specs):
    with pytest.raises(ValueError, match=r"import spec|list of at most"):
        _warm_imports.check_specs(specs)


def test_installed_means_site_packages_or_the_standard_library(tmp_path, monkeypatch):
    (tmp_path / "fsdpi_notebook_helper.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _warm_imports.installed("json")
    assert _warm_imports.installed("sys")  # built in
    assert _warm_imports.installed("psutil")  # a site-packages package
    assert not _warm_imports.installed("fsdpi_notebook_helper")  # a notebook's own module
    assert not _warm_imports.installed("fsdpi_no_such_module")


@pytest.fixture
def user_site(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A user site-packages folder under ``tmp_path`` holding three modules, and the
    environment that makes it the user site of a forker started with it."""
    base = tmp_path / "userbase"
    site_dir = Path(sysconfig.get_path("purelib", f"{os.name}_user", {"userbase": str(base)}))
    site_dir.mkdir(parents=True)
    (site_dir / "fsdpi_warm_plain.py").write_text("VALUE = 1\n")
    (site_dir / "fsdpi_warm_thread.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    (site_dir / "fsdpi_warm_prints.py").write_text("print('imported on stdout')\n")
    local = tmp_path / "notebook_folder"
    local.mkdir()
    (local / "fsdpi_warm_local.py").write_text("VALUE = 2\n")
    env = dict(
        os.environ,
        PYTHONUSERBASE=str(base),
        PYTHONPATH=os.pathsep.join([str(site_dir), str(local), os.getcwd()]),
    )
    env.pop("FSDPI_SNAPSHOT_ROOT", None)
    return site_dir, env


def test_a_forker_warms_installed_thread_free_modules_and_its_children_find_them(
    user_site, tmp_path, monkeypatch
):
    _, env = user_site
    specs = [
        "fsdpi_warm_plain",
        "fsdpi_warm_thread",
        "fsdpi_warm_prints",
        "fsdpi_warm_local",
        "colorsys:rgb_to_hls",
        "fsdpi_warm_missing",
        "json.no_such_submodule",
    ]
    forker = EngineForker(str(tmp_path / "forker.log"), env)
    try:
        forker.warm(specs)
        assert forker.wait_warm(specs, timeout=120), forker.log_tail()
        # Probed together, one thread started: each was then probed alone, and only the
        # module that starts it was left out.
        assert forker.warmed == {"fsdpi_warm_plain", "fsdpi_warm_prints", "colorsys:rgb_to_hls"}
        thread_reason = forker.warm_skipped["fsdpi_warm_thread"]
        assert "started 1 thread(s)" in thread_reason
        assert "not an installed package" in forker.warm_skipped["fsdpi_warm_local"]
        assert "not an installed package" in forker.warm_skipped["fsdpi_warm_missing"]
        assert "ModuleNotFoundError" in forker.warm_skipped["json.no_such_submodule"]
        # What an import printed went to the log, not into the protocol: forking still works.
        assert "imported on stdout" in forker.log_tail()
        monkeypatch.setenv(
            "FORKER_TEST_MODULES", "fsdpi_warm_plain,fsdpi_warm_thread,colorsys,wave"
        )
        child = Child(forker, ["0"], tmp_path / "child.log", tmp_path)
        assert child.wait() == 0
        assert child.report()["loaded"] == {
            "fsdpi_warm_plain": True,
            "fsdpi_warm_thread": False,
            "colorsys": True,
            "wave": False,
        }
        # A refused spec is answered from memory, without another probe.
        forker.warm_skipped.clear()
        forker.warm(["fsdpi_warm_thread"])
        assert forker.wait_warm(["fsdpi_warm_thread"], timeout=60)
        assert forker.warm_skipped == {"fsdpi_warm_thread": thread_reason}
        probes = Path(forker.log_path).read_text().count("'fsdpi_warm_thread': 'importing")
        assert probes == 1
    finally:
        forker.close()


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory):
    handle = EngineForker(str(tmp_path_factory.mktemp("warm") / "forker.log"), dict(os.environ))
    try:
        yield handle
    finally:
        handle.close()


def test_a_warm_request_for_modules_already_warmed_is_answered_at_once(forker):
    forker.warm(["colorsys"])
    assert forker.wait_warm(["colorsys"], timeout=120)
    forker.warm(["colorsys"])  # answered without a probe: nothing new to import
    pid = asyncio.run(forker.fork([*CHILD, "0"], dict(os.environ), os.getcwd(), os.devnull))
    assert pid > 0


def test_a_replayable_cells_imports_are_loaded_in_the_next_groups_engines(pool):
    check = "import sys\nprint([m for m in ('wave', 'tabnanny', 'zipapp') if m in sys.modules])"
    pool.run("import wave", stream=False)
    pool.run("import tabnanny", stream=False, replay=False)  # never replayed: not warmed
    forkers = pool._processes.forkers.forkers()
    assert forkers and all(f.wait_warm(["wave"], timeout=120) for f in forkers)
    assert all("tabnanny" not in f.warmed | set(f.warm_skipped) for f in forkers)
    pool.restart()
    result = pool.run(check, stream=False)
    assert result.stdout == {r: "['wave']\n" for r in range(pool.world_size)}


def test_a_warmed_module_that_binds_tqdm_auto_at_import_gives_the_engines_rank_bar(pool):
    # tqdm.contrib.concurrent binds tqdm.auto's class when imported, as transformers does:
    # imported in the forker, it must bind the rank bar, not the widget ipykernel would pick.
    pool.run("import tqdm.contrib.concurrent", stream=False)
    forkers = pool._processes.forkers.forkers()
    assert forkers and all(
        f.wait_warm(["tqdm.contrib.concurrent"], timeout=120) for f in forkers
    ), [f.warm_skipped for f in forkers]
    pool.restart()
    check = (
        "import tqdm.auto, tqdm.contrib.concurrent as concurrent\n"
        "bar = concurrent.tqdm_auto\n"
        "for _ in bar(range(3)):\n"
        "    pass\n"
        "print(bar is tqdm.auto.tqdm, any(k.__name__ == '_RankBar' for k in bar.__mro__),\n"
        "      any(k.__module__ == 'tqdm.notebook' for k in bar.__mro__))\n"
    )
    result = pool.run(check, stream=False)
    assert result.stdout == {r: "True True False\n" for r in range(pool.world_size)}


# Imported twice: by the forker's throwaway probe (which marks that it ran), then by the
# forker itself, which waits there, inside the import, until the test lets it go.
_GATED_MODULE = """
import os, time
gate = os.environ["FSDPI_TEST_IMPORT_GATE"]
if os.path.exists(gate + ".probed"):
    open(gate + ".importing", "w").close()
    while not os.path.exists(gate + ".go"):
        time.sleep(0.02)
else:
    open(gate + ".probed", "w").close()
"""


def test_an_engine_that_dies_while_its_forker_imports_is_reported_at_once(user_site, tmp_path):
    # The kernel waits seconds for a dead rank's status; a forker busy importing a large
    # package for a warm request used to report it only after the import, too late.
    site_dir, env = user_site
    (site_dir / "fsdpi_warm_gated.py").write_text(_GATED_MODULE)
    gate = tmp_path / "gate"
    forker = EngineForker(str(tmp_path / "forker.log"), dict(env, FSDPI_TEST_IMPORT_GATE=str(gate)))
    importing, go = Path(f"{gate}.importing"), Path(f"{gate}.go")
    try:
        child = Child(forker, ["sleep"], tmp_path / "child.log", tmp_path)
        child.report()  # it runs
        forker.warm(["fsdpi_warm_gated"])
        deadline = time.monotonic() + 120
        while not importing.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert importing.exists(), f"the forker never imported the module:\n{forker.log_tail()}"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
        assert "fsdpi_warm_gated" not in forker.warmed  # reported while the import still ran
        go.touch()
        assert forker.wait_warm(["fsdpi_warm_gated"], timeout=120), forker.log_tail()
        assert "fsdpi_warm_gated" in forker.warmed
        after = Child(forker, ["0"], tmp_path / "after.log", tmp_path)
        assert after.wait() == 0  # the forker serves on
    finally:
        go.touch()
        forker.close()
