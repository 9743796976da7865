"""A rank that makes an ipywidgets widget while the pool's client runs in an IPython shell
that is not a kernel (terminal IPython): the widget's messages are dropped and the pool
keeps receiving output and results. Real pool, real IPython shell, real ipywidgets."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import zmq
from IPython import get_ipython
from jupyter_client.session import Session

from fsdp_interactive.pool import Pool
from fsdp_interactive.pool._stray_comms import message_type
from tests.shell import shared_shell

WIDGET = "import ipywidgets\nslider = ipywidgets.IntSlider(value=rank)\nprint('made', rank)\n"


@pytest.fixture
def shell_without_kernel() -> Any:
    """This process's IPython shell (IPython's terminal test shell), which has no kernel."""
    shell = shared_shell()
    assert get_ipython() is shell and not hasattr(shell, "kernel")
    return shell


@pytest.mark.parametrize("packer", ["json", "pickle"])
def test_message_type_reads_the_header_as_the_session_packs_it(packer):
    session = Session(key=b"k", packer=packer, unpacker=packer)
    message = session.msg("comm_open", content={"comm_id": "c"})
    frames = [zmq.Frame(part) for part in session.serialize(message, ident=b"e")]
    assert message_type(session, frames) == "comm_open"
    assert message_type(session, [zmq.Frame(b"no"), zmq.Frame(b"delimiter")]) is None
    delimiter = zmq.Frame(b"<IDS|MSG>")
    assert message_type(session, [delimiter, zmq.Frame(b"sig"), zmq.Frame(b"not a header")]) is None


def test_a_ranks_widget_leaves_output_and_results_flowing(
    pool: Pool, shell_without_kernel: Any, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="fsdp_interactive.pool._stray_comms"):
        # replay=False: the forkers do not warm ipywidgets for the engines of later tests.
        made = pool.run(WIDGET, stream=False, replay=False)
        after = pool.run("print('after', rank)\nrank + 40", stream=False)
    assert made.stdout == {0: "made 0\n", 1: "made 1\n"}
    assert after.stdout == {0: "after 0\n", 1: "after 1\n"}
    assert after.results == {0: "40", 1: "41"}
    dropped = [r for r in caplog.records if "cannot be shown" in r.getMessage()]
    assert len(dropped) == 1 and "comm_open" in dropped[0].getMessage()
