"""The diagnostics agent and its client, in this process: real sockets, real threads."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from fsdp_interactive.pool.common import _agent_wire
from fsdp_interactive.pool.diagnostics._agent_client import RankAgents
from fsdp_interactive.pool.rank import _agent as _rank_agent

KEY = _agent_wire.derive_key(b"cluster key", b"nonce")


def _sleeping_thread(started: threading.Event, stop: threading.Event) -> None:
    marker = "sleeping here"  # noqa: F841 (a local the stack shows)
    started.set()
    while not stop.wait(0.05):
        pass


@pytest.fixture
def agent() -> Iterator[tuple[RankAgents, int]]:
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=_sleeping_thread, args=(started, stop), daemon=True)
    worker.start()
    started.wait(5)
    address = _rank_agent.start("127.0.0.1", KEY, user_thread=worker.ident)
    agents = RankAgents({0: address}, KEY, timeout=5)
    try:
        yield agents, worker.ident
    finally:
        agents.close()
        _rank_agent.stop()
        stop.set()
        worker.join(5)


def test_key_is_derived_per_nonce_and_needs_a_cluster_key():
    assert _agent_wire.derive_key(b"k", b"a") != _agent_wire.derive_key(b"k", b"b")
    assert len(KEY) == 32
    with pytest.raises(ValueError, match="HMAC key"):
        _agent_wire.derive_key(b"", b"a")


def test_agent_answers_stacks_of_every_thread_with_source_lines(agent):
    agents, user_thread = agent
    reply = agents.ask([0], {"op": "stacks"})[0]
    user = [t for t in reply["threads"] if t.user]
    assert len(user) == 1 and user[0].ident == user_thread
    sources = [f.source for f in user[0].frames]
    assert "while not stop.wait(0.05):" in sources
    assert user[0].frames[-1].function == "_bootstrap"
    assert agents.ask([0], {"op": "ping"})[0]["pid"] == os.getpid()


def test_a_peer_without_the_key_is_refused_and_the_agent_keeps_serving(agent):
    agents, _ = agent
    wrong = RankAgents(agents.addresses, _agent_wire.derive_key(b"other", b"nonce"), timeout=3)
    with pytest.raises(multiprocessing.AuthenticationError):
        wrong.ask_one(0, {"op": "ping"})
    assert wrong.ask([0], {"op": "ping"}) == {}
    assert agents.ask([0], {"op": "ping"})[0]["pid"] == os.getpid()


def test_unknown_requests_are_errors_not_crashes(agent):
    agents, _ = agent
    with pytest.raises(RuntimeError, match="unknown request 'nonsense'"):
        agents.ask_one(0, {"op": "nonsense"})


def test_a_silent_agent_times_out_instead_of_blocking():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts connections (kernel backlog) but never answers
    try:
        agents = RankAgents({0: listener.getsockname()}, KEY, timeout=0.5)
        began = time.monotonic()
        assert agents.ask([0], {"op": "ping"}) == {}
        assert time.monotonic() - began < 10
    finally:
        listener.close()


def test_fault_link_carries_faulthandler_dumps_on_the_stack_signal(agent):
    agents, user_thread = agent
    agents.open_links()
    dumps = agents.signal_dumps([0], lambda ranks: os.kill(os.getpid(), signal.SIGUSR1), 5.0)
    assert f"Thread 0x{user_thread:016x}" in dumps[0]
    assert "_sleeping_thread" in dumps[0]


def test_fault_link_dumps_arrive_when_the_kernel_holds_over_a_thousand_descriptors(agent):
    """A kernel that has run for a while holds descriptors past select()'s 1024 limit;
    the links opened then must still carry their dumps."""
    agents, user_thread = agent
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= 1200, f"this test needs RLIMIT_NOFILE's hard limit >= 1200, not {hard}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY)]
    try:
        while filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        agents.open_links()
        assert agents._fault[0].fileno() > 1024
        dumps = agents.signal_dumps([0], lambda ranks: os.kill(os.getpid(), signal.SIGUSR1), 5)
        assert f"Thread 0x{user_thread:016x}" in dumps[0]
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_across_hosts_the_channel_is_encrypted_and_a_plain_one_gets_only_a_fault_link(agent):
    agents, _ = agent
    address = agents.addresses[0]
    secure = _agent_wire.connect(address, KEY, 5)  # TCP: TLS by default
    try:
        assert secure.secure and secure._tls.cipher()[0] == "ADH-AES256-GCM-SHA384"
        secure.send({"op": "ping"})
        assert secure.recv()["pid"] == os.getpid()
    finally:
        secure.close()
    plain = _agent_wire.connect(address, KEY, 5, secure=False)
    try:
        plain.send({"op": "stacks"})
        assert plain.recv() == {"error": "'stacks' is answered only over TLS on this agent"}
        plain.send({"op": "fault_link"})  # what faulthandler writes into: code locations
        assert plain.recv() == {"ok": True}
    finally:
        plain.close()


def test_a_man_in_the_middle_relaying_the_challenges_is_refused(agent):
    """Someone between the kernel and a rank, holding a TLS session with each, relays every
    byte of the handshake: each side's proof is bound to its own session, so neither
    verifies, and what the relay sees of the sessions is all it gets."""
    import socket

    agents, _ = agent
    listener = socket.create_server(("127.0.0.1", 0))
    relayed: dict[str, object] = {}

    def relay() -> None:
        import select

        from fsdp_interactive.pool.common import _secure_link

        victim, _ = listener.accept()
        try:
            assert victim.recv(1) == b"S"
            kernel_side = _secure_link.wrap(victim, server=True)
            rank_side = socket.create_connection(agents.addresses[0], timeout=5)
            rank_side.sendall(b"S")
            rank_tls = _secure_link.wrap(rank_side, server=False)
            peer = {kernel_side: rank_tls, rank_tls: kernel_side}
            while True:  # every byte, both ways, until a side closes
                ready = [s for s in peer if s.pending()] or select.select(list(peer), [], [], 10)[0]
                if not ready:
                    return
                for source in ready:
                    data = source.recv(4096)
                    if not data:
                        return
                    relayed.setdefault("bytes", []).append(data)
                    peer[source].sendall(data)
        except (OSError, AssertionError) as exc:
            relayed["ended"] = type(exc).__name__

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        with pytest.raises((multiprocessing.AuthenticationError, OSError, EOFError)):
            _agent_wire.connect(listener.getsockname()[:2], KEY, 5)
    finally:
        thread.join(10)
        listener.close()
    assert relayed.get("bytes")  # the relay did pass the first challenge along
    assert agents.ask([0], {"op": "ping"})[0]["pid"] == os.getpid()  # the agent serves on
