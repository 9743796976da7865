"""Widget messages from the ranks, in a kernel-less IPython shell: dropped, not fatal.

Notebook side. Code on a rank that makes an ipywidgets widget (``tqdm.notebook``, a widget
of the user's own) publishes ``comm_*`` messages. ipyparallel's client hands them to the
kernel it runs in, after checking ``get_ipython().kernel``; a terminal IPython shell has no
such attribute, so the check raises inside the client's IOPub handler, and from then on
that client receives no more IOPub messages: no output, no results, with no error shown.
:func:`keep_iopub_alive` puts a filter in front of that handler that drops ``comm_*``
messages when the current shell has no kernel (where no widget could be shown anyway),
and logs the first one dropped; everything else goes to ipyparallel's handler unchanged.

ipyparallel names used (checked on ipyparallel 9.2.0): ``Client._iopub_stream`` (the
``ZMQStream`` of the IOPub socket), ``Client._dispatch_iopub`` (its handler, which takes
the raw frames) and ``Client._io_loop`` (the loop of the client's IO thread, where the
stream's callback is swapped, as the stream belongs to that thread). Where one is
missing, nothing is changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)


def _shell_without_kernel() -> bool:
    """Whether this process runs an IPython shell that is not a kernel's (the case where
    ipyparallel's handler fails on comm messages)."""
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and not hasattr(shell, "kernel")


def message_type(session: Any, frames: Sequence[Any]) -> str | None:
    """The ``msg_type`` of a raw message (its frames as ZeroMQ delivered them), read as
    ``session`` (the client's ``jupyter_client`` Session, with the packer the cluster
    chose) reads it, unpacking the header alone; ``None`` when the frames are not one."""
    try:
        _, parts = session.feed_identities(frames, copy=False)
        header = session.unpack(parts[1].bytes)  # parts: signature, header, ...
    except Exception:  # not a message: ipyparallel's handler reports those
        return None
    kind = header.get("msg_type") if isinstance(header, dict) else None
    return kind if isinstance(kind, str) else None


def comm_filter(session: Any, dispatch: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``dispatch`` (an IOPub handler taking raw frames, framed by ``session``) behind a
    filter that drops comm messages while this process's IPython shell has no kernel."""
    warned = False

    def dispatch_unless_stray_comm(frames: Any) -> Any:
        nonlocal warned
        kind = message_type(session, frames)
        if kind is not None and kind.startswith("comm_") and _shell_without_kernel():
            if not warned:
                warned = True
                log.info(
                    "a rank made an ipywidgets widget (%s); this shell is not a Jupyter "
                    "kernel, so it cannot be shown: its messages are dropped",
                    kind,
                )
            return None
        return dispatch(frames)

    return dispatch_unless_stray_comm


def keep_iopub_alive(client: Any) -> None:
    """Put :func:`comm_filter` in front of ``client``'s IOPub handler (in its IO thread;
    messages that arrive before the swap reach the handler as before)."""
    try:
        stream, dispatch, loop = client._iopub_stream, client._dispatch_iopub, client._io_loop
    except AttributeError as missing:
        log.debug("IOPub handler left as it is: %s", missing)
        return
    guarded = comm_filter(client.session, dispatch)
    loop.add_callback(lambda: stream.on_recv(guarded, copy=False))
