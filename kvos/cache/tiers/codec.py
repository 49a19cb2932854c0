"""Framing of a stored block: magic, checksum and length before the payload."""
from __future__ import annotations

import hashlib
import struct

MAGIC = b"KVOS2"
_HEADER = struct.Struct("<5s16sQ")
HEADER_SIZE = _HEADER.size


try:  # xxh3-128 runs at memory speed; blake2b is the fallback when xxhash is absent
    from xxhash import xxh3_128_digest as _fast_digest
except ImportError:  # pragma: no cover
    _fast_digest = None


def checksum(data: bytes | memoryview) -> bytes:
    """16-byte integrity check of a payload (not a security boundary: keys are content hashes)."""
    if _fast_digest is not None:
        return _fast_digest(data)
    return hashlib.blake2b(data, digest_size=16).digest()


def encode(data: bytes | memoryview) -> bytes:
    return b"".join([_HEADER.pack(MAGIC, checksum(data), len(data)), data])


def encode_into(dst: memoryview, data: bytes | memoryview) -> None:
    """Write the frame of ``data`` into ``dst``, which is exactly ``HEADER_SIZE + len(data)``
    bytes (no intermediate copy of the payload)."""
    _HEADER.pack_into(dst, 0, MAGIC, checksum(data), len(data))
    dst[HEADER_SIZE:] = data


def decode(blob: bytes | memoryview | None) -> memoryview | None:
    """A zero-copy view of the payload, or None when the frame is truncated, foreign or fails
    its checksum."""
    if blob is None or len(blob) < _HEADER.size:
        return None
    magic, digest, n = _HEADER.unpack_from(blob)
    data = memoryview(blob)[_HEADER.size:]
    if magic != MAGIC or n != len(data) or checksum(data) != digest:
        return None
    return data
