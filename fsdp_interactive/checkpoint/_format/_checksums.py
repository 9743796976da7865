"""The checksum algorithms a checkpoint's files are checked with, and hashing a file.

Standard library and ``xxhash`` only, importing nothing of the package: checkpoints
name the algorithm in their manifest (:mod:`fsdp_interactive.checkpoint._format._manifest`), and
the engine forker checks snapshot files ahead of a restore (:mod:`._prechecked`) in a
process that must not import the checkpoint package to do it.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from typing import Any

import xxhash

SHA256 = "sha256"
CRC32 = "crc32"
XXH3_64 = "xxh3_64"
#: The checksum algorithms a manifest may name.
CHECKSUMS = (SHA256, CRC32, XXH3_64)
#: Bytes read per call when checksumming a file: small enough to stay in the core's cache
#: between the read and the hash (256 KiB measured fastest of 256 KiB to 8 MiB here).
HASH_CHUNK = 256 << 10


class _Crc32:
    """zlib's CRC-32 with hashlib's ``update`` / ``hexdigest`` (8 hex digits)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_checksum(algorithm: str) -> Any:
    """A fresh hasher of ``algorithm`` (one of :data:`CHECKSUMS`): ``update(bytes)``,
    ``hexdigest()``."""
    if algorithm == CRC32:
        return _Crc32()
    if algorithm == XXH3_64:
        return xxhash.xxh3_64()
    if algorithm == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algorithm!r}; expected one of {CHECKSUMS}")


def checksum_of(data: Any, algorithm: str) -> str:
    """The ``algorithm`` checksum of the bytes ``data``, as hex."""
    digest = new_checksum(algorithm)
    digest.update(data)
    return digest.hexdigest()


def hash_descriptor(fd: int, algorithm: str) -> tuple[int, str]:
    """(bytes read, hex ``algorithm`` checksum) of what the open file ``fd`` holds from its
    current offset to its end."""
    digest = new_checksum(algorithm)
    size = 0
    buffer = bytearray(HASH_CHUNK)
    view = memoryview(buffer)
    while count := os.readv(fd, [buffer]):
        digest.update(view[:count])
        size += count
    return size, digest.hexdigest()
