"""``%%fsdp`` and ``%fsdp status`` in a real IPython shell whose pool spans two hosts.

The pool (one rank on hosta, one on hostb, ssh launcher) is handed to the shell's
``%fsdp`` magics: ``%fsdp start`` has no options for a launcher's configuration, which
these hosts need (controller address, ssh options).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fsdp_interactive.pool import RankError
from tests.multihost.launchers import running_ssh_pool
from tests.shell import shared_shell

pytestmark = pytest.mark.multihost


@pytest.fixture(scope="module")
def remote_shell(testhosts, tmp_path_factory) -> Iterator[Any]:
    """An IPython shell with the extension loaded and a pool on hosta and hostb."""
    shell = shared_shell()
    shell.run_line_magic("load_ext", "fsdp_interactive")
    magics = shell.magics_manager.registry["FsdpMagics"]
    profile_dir = str(tmp_path_factory.mktemp("magics-profile"))
    with running_ssh_pool(testhosts, 1, profile_dir) as pool:
        magics.pool = pool
        try:
            yield shell
        finally:
            magics.pool = None


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_cell_output_is_tagged_by_rank_from_both_hosts(remote_shell, capsys, stream):
    result = remote_shell.run_cell(
        f"%%fsdp {stream} --group-outputs rank\nimport socket\nprint(rank, socket.gethostname())"
    )
    assert result.success, result.error_in_exec
    lines = capsys.readouterr().out.splitlines()
    assert "[rank 0] 0 hosta" in lines and "[rank 1] 1 hostb" in lines, lines


def test_a_remote_ranks_exception_shows_its_traceback_with_the_cell_number(remote_shell):
    result = remote_shell.run_cell(
        "%%fsdp --no-stream\nvalue = 1\nif rank == 1:\n    raise KeyError('on hostb')"
    )
    error = result.error_in_exec
    assert isinstance(error, RankError) and error.ranks == [1], error
    number = result.execution_count
    assert f"Cell In[{number}], line 3" in error.tracebacks[1]  # line 3 of the body
    assert "KeyError: 'on hostb'" in error.tracebacks[1]
    assert "rank 1" in "\n".join(error._render_traceback_())


def test_status_lists_both_hosts(remote_shell, capsys):
    remote_shell.run_line_magic("fsdp", "status")
    out = capsys.readouterr().out
    assert "pool running, 2 ranks" in out
    assert "2 hosts: hosta r0, hostb r1" in out
    rows = [line.split() for line in out.splitlines()]
    assert ["0", "0", "hosta"] in [row[:3] for row in rows]
    assert ["1", "0", "hostb"] in [row[:3] for row in rows]
