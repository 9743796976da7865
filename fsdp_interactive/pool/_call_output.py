"""What the ranks of one call publish, as they publish it: stream chunks and displays.

Notebook side. Every engine sends its output over its IOPub channel; the ipyparallel
client files it under the call's request. The client's own record
(``AsyncResult.stdout``) is not the stream: each time a chunk holds a carriage return
the client rewrites the text it keeps (``.*\\r`` removed), so the text shrinks and a
reader of new characters reads garbage; display updates (``update_display_data``) are
not kept at all. :class:`CallOutput` therefore subscribes to each request's messages as
they arrive, and hands them over in order, unaltered: :class:`RankText` for a chunk of
stdout or stderr, :class:`RankDisplay` for a display or an update of one.

The client's I/O thread updates its record for a message, then calls the request's
callbacks with it. A callback added late (after the first messages) would miss those, so
the first time it is called it takes the client's record instead, which then holds every
message so far, the current one included; a request whose callback is never called (no
output at all) has its record read once its output is complete. Each message is thus
seen once, at the cost of one callback per message on that thread and no message sent.

A rank may also print and then wait, sending nothing more until its output is seen; when
the record holds output that no callback has taken, the record is taken on the client's
I/O thread, between two messages (:func:`_on_io_thread`).

The record keeps no display update, so an update that arrived before the subscription
would be lost (a ``tqdm.auto`` bar whose messages all came first would stay at its first
state, never closed). Every call whose output is streamed (``Pool.run``, ``Pool.call``,
the start-up steps whose output is shown) therefore sends its requests through
:func:`send_requests`, from the client's I/O thread with a :class:`RequestWatch` on each:
the thread sends a request only after the callback that made it returns, so the watch
sees every message of the request, and keeps them until a :class:`CallOutput` takes them
over, in order, none twice.

ipyparallel names used: ``AsyncResult._children`` (the request's ``MessageFuture``, whose
public ``iopub_callbacks`` list receives every IOPub message of the request; checked on
ipyparallel 9.2.0) and ``Client._io_loop``. Where it is missing the record is read instead, each time
:meth:`CallOutput.take` is called: a text that shrank is handed on as a carriage return
and its current line, and displays as they were first published (their updates are not
seen).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class RankText:
    """A chunk of a rank's ``name`` stream ("stdout" or "stderr"), as the rank wrote it."""

    name: str
    text: str


@dataclass(frozen=True)
class RankDisplay:
    """A display a rank published: its MIME bundle ``data`` and ``metadata``;
    ``display_id``: the rank's id for it (``None``: none); ``update``: an update of the
    display the rank published earlier under that id."""

    data: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    display_id: str | None = None
    update: bool = False


Item = RankText | RankDisplay


def display_of(content: Mapping[str, Any], update: bool = False) -> RankDisplay:
    """A ``display_data`` (or ``update_display_data``) message's content as a RankDisplay."""
    transient = content.get("transient") or {}
    display_id = transient.get("display_id") if isinstance(transient, dict) else None
    return RankDisplay(
        data=dict(content.get("data") or {}),
        metadata=dict(content.get("metadata") or {}),
        display_id=str(display_id) if display_id is not None else None,
        update=update,
    )


def _has_output(record: Mapping[str, Any]) -> bool:
    return any(record.get(name) for name in STREAMS) or bool(record.get("outputs"))


def _on_io_thread(handle: Any, action: Any) -> None:
    """Run ``action()`` on the client's I/O thread, which records each IOPub message and
    then calls its request's callbacks in one go; run at once where that thread's loop is
    not reachable (``Client._io_loop``, ipyparallel's private tornado loop, checked on
    ipyparallel 9.2.0; its ``add_callback`` may be called from any thread)."""
    loop = getattr(getattr(handle, "_client", None), "_io_loop", None)
    if loop is None or not callable(getattr(loop, "add_callback", None)):
        action()
        return
    loop.add_callback(action)


class RequestWatch:
    """An ``iopub_callbacks`` entry that keeps every IOPub message of one request from its
    first, until :meth:`hand_over` gives them, and every later one, to a consumer; after
    :meth:`close` messages are dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[dict[str, Any]] = []
        self._consumer: Callable[[dict[str, Any]], None] | None = None
        self._closed = False

    def __call__(self, message: dict[str, Any]) -> None:
        """On the client's I/O thread, for each message of the request."""
        with self._lock:
            if self._closed:
                return
            if self._consumer is None:
                self._kept.append(message)
                return
            consumer = self._consumer
        consumer(message)

    def hand_over(self, consumer: Callable[[dict[str, Any]], None]) -> None:
        with self._lock:
            for message in self._kept:
                consumer(message)
            self._kept = []
            self._consumer = consumer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._kept, self._consumer = [], None


def _watch_of(future: Any) -> RequestWatch | None:
    return next((c for c in future.iopub_callbacks if isinstance(c, RequestWatch)), None)


def send_requests(
    views: Mapping[int, Any], send: Callable[[int, Any], Any], *, watched: bool = True
) -> dict[int, Any]:
    """``send(rank, view)`` for each rank's single-engine view: it sends the rank's request
    and returns its AsyncResult (``view.execute(code, block=False, silent=False)``,
    ``view.apply_async(...)``); rank -> AsyncResult. ``watched``: the requests' output is
    to be streamed, so every request is watched from its first message (see the module's
    notes); a :class:`CallOutput` of them must take the watches over, or close them.

    Watched requests are made on the client's I/O thread (``Client._io_loop``, checked on
    ipyparallel 9.2.0), which queues each send behind this callback; where that loop is
    not reachable they are made here, and a message that comes before its watch is taken
    from the record as for any late subscription. What ``send`` raises (an argument that
    cannot be serialised) is raised here.
    """
    views = dict(views)

    def make() -> dict[int, Any]:
        handles = {}
        for rank, view in views.items():
            handle = send(rank, view)
            future = _request_future(handle) if watched else None
            if future is not None:
                future.iopub_callbacks.append(RequestWatch())
            handles[rank] = handle
        return handles

    if not watched or not views:
        return make()
    client = getattr(next(iter(views.values())), "client", None)
    loop = getattr(client, "_io_loop", None)
    thread = getattr(client, "_io_thread", None)
    if (
        not callable(getattr(loop, "add_callback", None))
        or not getattr(thread, "is_alive", lambda: False)()
    ):
        return make()
    made: concurrent.futures.Future[dict[int, Any]] = concurrent.futures.Future()

    def on_io_thread() -> None:
        try:
            made.set_result(make())
        except BaseException as error:  # handed to the caller
            made.set_exception(error)

    loop.add_callback(on_io_thread)
    return made.result()


def received_metadata(handle: Any) -> dict[str, Any]:
    """A single-engine AsyncResult's metadata dict, as received.

    ``AsyncResult.metadata`` parses every timestamp field with dateutil on each access
    until all have arrived, which costs more than a short call's whole round trip; only
    the output fields are read here, so the received dict is used as it is.

    ``AsyncResult._metadata`` is ipyparallel's private list of received dicts (checked on
    ipyparallel 9.0 and 9.2.0); were it gone or shaped otherwise, the public
    ``metadata`` is read instead.
    """
    received = getattr(handle, "_metadata", None)
    if isinstance(received, list) and len(received) == 1 and isinstance(received[0], dict):
        return received[0]
    return handle.metadata


def _request_future(handle: Any) -> Any | None:
    children = getattr(handle, "_children", None)
    if not isinstance(children, list) or len(children) != 1:
        return None
    future = children[0]
    return future if isinstance(getattr(future, "iopub_callbacks", None), list) else None


class CallOutput:
    """The output of one call's ranks (``handles``: rank -> single-engine AsyncResult).

    :meth:`take` returns what arrived since the last take, as ``(rank, item)`` pairs in
    each rank's own order; :meth:`close` ends the subscription (later output is dropped).
    ``subscribe=False`` reads the client's record instead (see the module's notes).
    """

    def __init__(self, handles: Mapping[int, Any], subscribe: bool = True) -> None:
        self._handles = dict(handles)
        self._arrived: collections.deque[tuple[int, Item]] = collections.deque()
        self._lock = threading.Lock()
        self._caught_up: set[int] = set()  # ranks whose record was taken
        self._catching_up: set[int] = set()  # ranks whose record is to be taken
        self._subscribed: dict[int, tuple[Any, Any]] = {}
        self._read: dict[tuple[int, str], str] = {}
        self._read_displays: dict[int, int] = {}
        futures = {rank: _request_future(h) for rank, h in self._handles.items()}
        self._polled = not subscribe or any(f is None for f in futures.values())
        if self._polled:
            if subscribe and self._handles:
                log.debug("ipyparallel's request futures are not reachable: reading its record")
            return
        for rank, future in futures.items():
            watch = _watch_of(future)
            if watch is not None:  # every message of the request, from its first
                self._caught_up.add(rank)
                self._subscribed[rank] = (future, watch)
                watch.hand_over(functools.partial(self._take_message, rank))
                continue
            callback = functools.partial(self._on_message, rank)
            self._subscribed[rank] = (future, callback)
            future.iopub_callbacks.append(callback)

    def _catch_up(self, rank: int) -> bool:
        """Take what the client's record holds of ``rank``, once; whether this call did."""
        with self._lock:
            if rank in self._caught_up:
                return False
            self._caught_up.add(rank)
            record = received_metadata(self._handles[rank])
            for name in STREAMS:
                if record.get(name):
                    self._arrived.append((rank, RankText(name, record[name])))
            for content in record.get("outputs") or []:
                self._arrived.append((rank, display_of(content)))
            return True

    def _on_message(self, rank: int, message: dict[str, Any]) -> None:
        """On the client's I/O thread, for every IOPub message of the rank's request, after
        the client recorded it."""
        kind = message.get("header", {}).get("msg_type")
        if self._catch_up(rank) and kind != "update_display_data":
            return  # the record held this message (updates are not recorded)
        self._take_message(rank, message)

    def _take_message(self, rank: int, message: dict[str, Any]) -> None:
        """One IOPub message of the rank's request as an item (other kinds are ignored)."""
        kind = message.get("header", {}).get("msg_type")
        content = message.get("content") or {}
        if kind == "stream":
            self._arrived.append((rank, RankText(content.get("name", "stdout"), content["text"])))
        elif kind == "display_data":
            self._arrived.append((rank, display_of(content)))
        elif kind == "update_display_data":
            self._arrived.append((rank, display_of(content, update=True)))

    def take(self) -> list[tuple[int, Item]]:
        if self._polled:
            return self._poll()
        for rank, handle in self._handles.items():
            if rank in self._caught_up:
                continue
            if handle.wait_for_output(0):
                self._catch_up(rank)  # no message ever called back: read the record
            elif rank not in self._catching_up and _has_output(received_metadata(handle)):
                # Output arrived before the subscription, and no message since (the rank
                # may wait for that very output to be seen): catch up on the client's I/O
                # thread, between two messages, so no message is taken twice or missed.
                self._catching_up.add(rank)
                _on_io_thread(handle, functools.partial(self._catch_up, rank))
        taken = []
        while self._arrived:
            taken.append(self._arrived.popleft())
        return taken

    def close(self) -> None:
        """Stop listening (once the calls' output is complete, no message can come)."""
        subscribed, self._subscribed = self._subscribed, {}
        for future, callback in subscribed.values():
            if isinstance(callback, RequestWatch):
                callback.close()
            if callback in future.iopub_callbacks:
                future.iopub_callbacks.remove(callback)

    def _poll(self) -> list[tuple[int, Item]]:
        taken: list[tuple[int, Item]] = []
        for rank, handle in self._handles.items():
            record = received_metadata(handle)
            for name in STREAMS:
                chunk = self._new_text(rank, name, record.get(name) or "")
                if chunk:
                    taken.append((rank, RankText(name, chunk)))
            outputs = record.get("outputs") or []
            seen = self._read_displays.get(rank, 0)
            taken += [(rank, display_of(content)) for content in outputs[seen:]]
            self._read_displays[rank] = len(outputs)
        return taken

    def _new_text(self, rank: int, name: str, text: str) -> str:
        """What ``text`` (the client's record) adds to what was read of it before.

        The record's completed lines never change; its current line may be rewritten
        (the client drops what a carriage return replaced), and is then handed on as a
        carriage return followed by the line as it is now.
        """
        before = self._read.get((rank, name), "")
        self._read[(rank, name)] = text
        if text.startswith(before):
            return text[len(before) :]
        line_start = before.rfind("\n") + 1
        return "\r" + text[line_start:]
