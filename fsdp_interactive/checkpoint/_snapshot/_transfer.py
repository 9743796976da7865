"""Files sent between ranks over torch.distributed (gloo), so that a host keeps files it
did not write: the ring copy of a snapshot, or the files a host lacks at restore time.

Every rank of the group calls :func:`exchange` with the same list of :class:`Transfer`;
a rank reads the files it sends from its own ``source`` folder and writes the files it
receives into its own ``target`` folder. Files travel in chunks of at most
``chunk_bytes`` (bounded memory), all transfers' chunks of one round at once (pairs of
hosts copy in parallel). A received file is written under a new dot-name (mode 0600,
never through a link), checked against the size and checksum its manifest record gives
(what the receiving rank holds: at a restore, a manifest whose seal it checked with the
pool's key, :mod:`.._format._snapshot_seal`; never a value that came with the file), then renamed
into place, so a file that is there is whole and the one the manifest names. The checksum
catches damage on the way; bytes crafted to match it would have to be injected into
torch's own traffic between the hosts, which must run on a trusted network
(docs/security.md).

A failure (a file that cannot be read or written, a checksum that does not match) does
not stop the exchange, whose collectives must go on for the peers: the sender sends
zeros instead, and the problem comes back in :class:`Exchanged` for the caller to agree
on. A peer that dies makes the send or receive raise (gloo's closed connection) on its
partners; the others may wait until the group's timeout.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist

from fsdp_interactive import _private_files
from fsdp_interactive._ranks import Ranks
from fsdp_interactive.checkpoint import _checkpoint_folders
from fsdp_interactive.checkpoint._format import _manifest
from fsdp_interactive.checkpoint._format._checksums import new_checksum

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Transfer:
    """Send file ``name`` (as ``record``, its manifest entry, says it is) from rank ``src``
    to ``dst``."""

    name: str
    record: _manifest.FileRecord
    src: int
    dst: int

    @property
    def size(self) -> int:
        return self.record.size


@dataclass
class Exchanged:
    """What one rank sent and received, and what went wrong on it."""

    sent_bytes: int = 0
    received: list[str] = field(default_factory=list)
    received_bytes: int = 0
    problems: list[str] = field(default_factory=list)


def _chunks(size: int, chunk_bytes: int) -> int:
    return math.ceil(size / chunk_bytes)


class _Outgoing:
    def __init__(self, transfer: Transfer, folder: Path, result: Exchanged):
        self.transfer, self.result = transfer, result
        self.path = folder / transfer.name
        self.file: BinaryIO | None = None
        try:
            fd = _private_files.open_regular(self.path)
            self.file = os.fdopen(fd, "rb")  # closed in close()
        except OSError as exc:
            result.problems.append(f"cannot read {folder / transfer.name} to send it: {exc}")

    def read(self, offset: int, length: int) -> torch.Tensor:
        buffer = torch.zeros(length, dtype=torch.uint8)
        if self.file is not None:
            try:
                self.file.seek(offset)
                got = self.file.readinto(memoryview(buffer.numpy()))
                if got != length:
                    raise OSError(f"read {got} of {length} bytes at offset {offset}")
            except OSError as exc:
                self.result.problems.append(f"reading {self.path} to send it failed: {exc}")
                self.close()
        self.result.sent_bytes += length
        return buffer

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class _Incoming:
    def __init__(self, transfer: Transfer, folder: Path, token: str, result: Exchanged):
        self.transfer, self.result = transfer, result
        self.final = folder / transfer.name
        self.temporary = folder / f".{transfer.name}.incoming-{token}"  # token: one per transfer
        self.digest = new_checksum(transfer.record.algorithm)
        self.file: BinaryIO | None = None
        try:
            self.file = os.fdopen(_private_files.create_file(self.temporary), "wb")
        except OSError as exc:
            result.problems.append(f"cannot write {self.temporary}: {exc}")

    def write(self, buffer: torch.Tensor) -> None:
        data = buffer.numpy()
        self.digest.update(data)
        if self.file is not None:
            try:
                self.file.write(data)
            except OSError as exc:
                self.result.problems.append(f"writing {self.temporary} failed: {exc}")
                self.file.close()
                self.file = None

    def finish(self) -> None:
        file, self.file = self.file, None
        if file is None:
            self.discard()
            return
        try:
            file.flush()
            os.fsync(file.fileno())
        finally:
            file.close()
        if self.digest.hexdigest() != self.transfer.record.digest:
            self.result.problems.append(
                f"{self.final}: the copy received from rank {self.transfer.src} does not "
                "match its checksum (the sender's file is damaged)"
            )
            self.discard()
            return
        os.replace(self.temporary, self.final)
        self.result.received.append(self.transfer.name)
        self.result.received_bytes += self.transfer.size

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        with contextlib.suppress(OSError):
            self.temporary.unlink()


def _peer(ranks: Ranks, rank: int) -> int:
    return dist.get_global_rank(ranks.group, rank) if ranks.group is not None else rank


def exchange(
    transfers: list[Transfer],
    ranks: Ranks,
    *,
    source: Path,
    target: Path,
    chunk_bytes: int = CHUNK_BYTES,
) -> Exchanged:
    """Carry out ``transfers`` (collective over ``ranks``; the same list on every rank)."""
    result = Exchanged()
    if not transfers:
        return result
    me = ranks.rank
    token = _checkpoint_folders.new_token()
    outgoing = {i: _Outgoing(t, source, result) for i, t in enumerate(transfers) if t.src == me}
    incoming = {
        i: _Incoming(t, target, f"{token}-{i}", result)
        for i, t in enumerate(transfers)
        if t.dst == me
    }
    rounds = max(_chunks(t.size, chunk_bytes) for t in transfers)
    try:
        for step in range(rounds):
            works, received = [], []
            for index, out in outgoing.items():
                offset = step * chunk_bytes
                if offset < out.transfer.size:
                    length = min(chunk_bytes, out.transfer.size - offset)
                    data = out.read(offset, length)
                    works.append(
                        dist.isend(data, _peer(ranks, out.transfer.dst), ranks.group, tag=index)
                    )
            for index, into in incoming.items():
                offset = step * chunk_bytes
                if offset < into.transfer.size:
                    buffer = torch.empty(
                        min(chunk_bytes, into.transfer.size - offset), dtype=torch.uint8
                    )
                    works.append(
                        dist.irecv(buffer, _peer(ranks, into.transfer.src), ranks.group, tag=index)
                    )
                    received.append((into, buffer))
            for work in works:
                work.wait()
            for into, buffer in received:
                into.write(buffer)
        for into in incoming.values():
            into.finish()
    finally:
        for out in outgoing.values():
            out.close()
        for into in incoming.values():
            if into.file is not None:  # the exchange broke off: no half file stays
                into.discard()
    logger.debug(
        "rank %d sent %d bytes and received %d files (%d bytes)",
        me,
        result.sent_bytes,
        len(result.received),
        result.received_bytes,
    )
    return result
