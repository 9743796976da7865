"""The command a pool's controller runs: ipyparallel's controller, its channels private.

``python -m fsdp_interactive._controller_entry [ipcontroller arguments]``

At the package's root, importing nothing of it, so that the controller starts without
importing the pool (as :mod:`fsdp_interactive._engine_parent` does).

Its settings come in ``$FSDPI_CONTROLLER`` (JSON, taken out of the environment at once),
never on the command line, where every local user reads them:

* ``"ipc"``: the pool's socket folder (:mod:`fsdp_interactive.pool.common._socket_folder`):
  every channel (registration, the engines' and the client's queues, IOPub, heartbeats,
  the schedulers' internal ones) is a unix socket there, ipyparallel's ``ipc``
  transport, which no other local user can connect to;
* ``"curve"``: CurveZMQ on every channel (ipyparallel's ``enable_curve``): the controller
  makes its key pair in this process, and only its public key leaves it, in the
  connection files (mode 0600, in the profile's private ``security`` folder). The
  messages' HMAC signatures are kept too (ipyparallel would drop them under CurveZMQ):
  the diagnostics channel derives its key from the session key;
* ``"log_dir"``: the pool's private log folder, where the controller's engine-state file
  goes instead of the profile's shared ``log`` folder.

The process runs with umask 077: what it writes (connection files, its schedulers' and
heart monitor's files, the engine-state file) is private to the user.

Two things of ipyparallel 9.2.0's controller are changed here (checked on 9.2.0): with the
``ipc`` transport it names each socket ``<prefix>-<port>`` while its clients and engines
name it ``<prefix>:<port>`` (they could never connect); here both use ``:``. And the
engine-state file's place.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any

#: The environment variable holding the controller's settings (JSON).
SETTINGS_ENV = "FSDPI_CONTROLLER"
MODULE = "fsdp_interactive._controller_entry"


def controller_command(python: str = sys.executable) -> list[str]:
    """The ``controller_cmd`` of ipyparallel's local controller launcher that runs this
    entry (the settings go in its environment: :func:`settings_env`)."""
    return [python, "-m", MODULE]


def settings_env(*, ipc: str | None, curve: bool, log_dir: str | None) -> dict[str, str]:
    """The controller's environment entry for these settings (see the module)."""
    return {SETTINGS_ENV: json.dumps({"ipc": ipc, "curve": curve, "log_dir": log_dir})}


def _controller_class() -> Any:
    from ipyparallel.controller.app import IPController

    class PrivateController(IPController):
        """ipyparallel's controller: one ``:`` before every port, and the engine-state
        file in the pool's private log folder."""

        private_log_dir: str | None = None

        def construct_url(self, kind: str, channel: str, index: Any = None) -> str:
            info = {
                "engine": self.engine_info,
                "client": self.client_info,
                "internal": getattr(self, "internal_info", None),
            }.get(kind)
            if info is None:
                return super().construct_url(kind, channel, index)
            port = info[channel] if index is None else info[channel][index]
            return f"{info['interface']}:{port}"

        def init_hub(self) -> None:
            super().init_hub()
            if self.private_log_dir:
                name = os.path.basename(self.hub.engine_state_file)
                self.hub.engine_state_file = os.path.join(self.private_log_dir, name)

    return PrivateController


def main(argv: list[str] | None = None) -> int:
    os.umask(0o077)
    settings = json.loads(os.environ.pop(SETTINGS_ENV, "") or "{}")
    from traitlets.config import Config

    config = Config()
    if settings.get("ipc"):
        config.IPController.transport = "ipc"
        # Each socket is <folder>/c:<port> (the socket folder's names are short).
        config.IPController.ip = os.path.join(settings["ipc"], "c")
    if settings.get("curve"):
        # Set before enable_curve, which blanks the key only when none was configured.
        config.Session.key = secrets.token_hex(32).encode()
        config.IPController.enable_curve = True
    controller = _controller_class()
    controller.private_log_dir = settings.get("log_dir")
    controller.launch_instance(argv=sys.argv[1:] if argv is None else argv, config=config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
