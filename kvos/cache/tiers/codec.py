"""Framing of a stored block: magic, checksum and length before the payload."""
from __future__ import annotations

import hashlib
import struct

MAGIC = b"KVOS1"
_HEADER = struct.Struct("<5s16sQ")


def checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def encode(data: bytes) -> bytes:
    return _HEADER.pack(MAGIC, checksum(data), len(data)) + data


def decode(blob: bytes | None) -> bytes | None:
    """The payload, or None when the frame is truncated, foreign or fails its checksum."""
    if blob is None or len(blob) < _HEADER.size:
        return None
    magic, digest, n = _HEADER.unpack_from(blob)
    data = blob[_HEADER.size:]
    if magic != MAGIC or n != len(data) or checksum(data) != digest:
        return None
    return data
