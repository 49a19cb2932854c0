"""Framing of a stored block, bound to the key it is stored under.

Two frame kinds, told apart by their magic:

- plain (``PlainCodec``): ``magic | digest | length | payload``, where ``digest`` is a 16-byte
  hash of ``len(key) | key | payload``. It detects torn, corrupt, stale-format and swapped
  blocks (a valid frame copied under another key fails, because the key is hashed in), but it
  is not a security boundary: anyone who can write the store can forge a frame.
- sealed (``SealedCodec``, AES-256-GCM): ``magic | nonce | length | ciphertext+tag`` with a
  random 12-byte nonce per write and the key as associated data. Nobody without the 32-byte
  key can read a payload, and a frame fails authentication unless it was written by a holder
  of the key *under this very block key*.

- digest (``DigestCodec``, the CPU tier's on a GPU): ``magic | digest ^ H(key) | 0 | length |
  payload``, where ``digest`` is a 64-bit digest of the payload that the caller computes where
  the bytes are (``kvos.worker.block_digest``: on the device, before the copy to the host). A load
  is checked after its copy to the device, by digesting the copied rows there (``split`` hands
  out the expected digest without reading the payload); ``decode`` checks on the host.

Invariant of all: ``decode(key, encode(key, data)) == data``, and ``decode`` returns None (it
never raises) for anything else: another key's frame, a truncated or altered frame, a frame of
another kind or of an older format, or a sealed frame written with another encryption key.
"""
from __future__ import annotations

import hashlib
import os
import stat
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

MAGIC = b"KVOS3"
"""Plain frames; "KVOS2" frames (checksum of the payload only, not bound to a key) are rejected."""
SEALED_MAGIC = b"KVOE1"
DIGEST_MAGIC = b"KVOD1"
_DIGEST_HEADER = struct.Struct("<5sq8xQ")  # magic, digest ^ key hash, padding, length: HEADER_SIZE bytes
_HEADER = struct.Struct("<5s16sQ")
HEADER_SIZE = _HEADER.size
_SEALED_HEADER = struct.Struct("<5s12sQ")  # magic, nonce, ciphertext length (tag included)
KEY_FIELD = "tier_encryption_key_file"
_KEY_LEN = struct.Struct("<Q")

try:  # xxh3-128 runs at memory speed; blake2b is the fallback when xxhash is absent
    from xxhash import xxh3_128 as _fast_hasher
except ImportError:  # pragma: no cover
    _fast_hasher = None
assert _DIGEST_HEADER.size == HEADER_SIZE


def checksum(data: bytes | memoryview, key: bytes = b"") -> bytes:
    """16-byte hash of ``len(key) | key | data``, streamed (the payload is not copied). The key
    length is hashed first so that no (key, data) pair collides with a shifted split of the
    same bytes."""
    h = _fast_hasher() if _fast_hasher is not None else hashlib.blake2b(digest_size=16)
    h.update(_KEY_LEN.pack(len(key)))
    h.update(key)
    h.update(data)
    return h.digest()


class PlainCodec:
    """Keyed-checksum frames (see the module docstring); the CPU tier's codec and the default."""

    sealed = False
    header_size = HEADER_SIZE

    def frame_size(self, payload_len: int) -> int:
        return HEADER_SIZE + payload_len

    def encode(self, key: bytes, data: bytes | memoryview) -> bytes:
        return b"".join([_HEADER.pack(MAGIC, checksum(data, key), len(data)), data])

    def encode_into(self, dst: memoryview, key: bytes, data: bytes | memoryview) -> None:
        """Write the frame of ``data`` under ``key`` into ``dst``, which is exactly
        ``HEADER_SIZE + len(data)`` bytes (no intermediate copy of the payload)."""
        dst[HEADER_SIZE:] = data
        self.write_header(dst, key)

    def write_header(self, dst: memoryview, key: bytes, digest: int | None = None) -> None:
        """Frame the payload already in ``dst[HEADER_SIZE:]`` under ``key``."""
        _HEADER.pack_into(dst, 0, MAGIC, checksum(dst[HEADER_SIZE:], key), len(dst) - HEADER_SIZE)

    def decode(self, key: bytes, blob: bytes | memoryview | None) -> memoryview | None:
        """A zero-copy view of the payload, or None when the frame is truncated, foreign, of
        another format or stored under another key."""
        if blob is None or len(blob) < HEADER_SIZE:
            return None
        magic, digest, n = _HEADER.unpack_from(blob)
        data = memoryview(blob)[HEADER_SIZE:]
        if magic != MAGIC or n != len(data) or checksum(data, key) != digest:
            return None
        return data


def key_hash64(key: bytes) -> int:
    """A signed 64-bit hash of a block key (binds a digest frame to the key it is stored under)."""
    return int.from_bytes(checksum(b"", key)[:8], "little", signed=True)


Digest = Callable[[bytes | memoryview], int]
"""The payload's 64-bit digest, as a signed int (``kvos.worker.block_digest`` on host rows)."""


class DigestCodec:
    """Frames holding a caller-computed payload digest bound to the key (see the module
    docstring). ``digest_fn`` computes it on the host when the caller has none (``encode`` without
    ``digest``) and in ``decode``; the CPU tier's hot paths never call it."""

    sealed = False
    header_size = HEADER_SIZE

    def __init__(self, digest_fn: Digest) -> None:
        self.digest_fn = digest_fn

    def frame_size(self, payload_len: int) -> int:
        return HEADER_SIZE + payload_len

    def encode_into(self, dst: memoryview, key: bytes, data: bytes | memoryview, digest: int | None = None) -> None:
        dst[HEADER_SIZE:] = data
        self.write_header(dst, key, digest)

    def write_header(self, dst: memoryview, key: bytes, digest: int | None = None) -> None:
        """Frame the payload already in ``dst[HEADER_SIZE:]`` under ``key`` (``digest``: its
        digest, computed here when None)."""
        if digest is None:
            digest = self.digest_fn(dst[HEADER_SIZE:])
        _DIGEST_HEADER.pack_into(dst, 0, DIGEST_MAGIC, digest ^ key_hash64(key), len(dst) - HEADER_SIZE)

    def encode(self, key: bytes, data: bytes | memoryview, digest: int | None = None) -> bytes:
        out = bytearray(HEADER_SIZE + len(data))
        self.encode_into(memoryview(out), key, data, digest)
        return bytes(out)

    def split(self, key: bytes, blob: bytes | memoryview | None) -> tuple[memoryview, int] | None:
        """(a view of the unverified payload, the digest it must have), or None when the frame is
        truncated or not a digest frame. Only the header is read."""
        if blob is None or len(blob) < HEADER_SIZE:
            return None
        magic, field, n = _DIGEST_HEADER.unpack_from(blob)
        data = memoryview(blob)[HEADER_SIZE:]
        if magic != DIGEST_MAGIC or n != len(data):
            return None
        return data, field ^ key_hash64(key)

    def decode(self, key: bytes, blob: bytes | memoryview | None) -> memoryview | None:
        """The payload verified on the host (``digest_fn``), or None."""
        got = self.split(key, blob)
        if got is None or self.digest_fn(got[0]) != got[1]:
            return None
        return got[0]


class SealedCodec:
    """AES-256-GCM frames (see the module docstring): confidentiality of the payload at rest and
    authentication of (payload, block key). ``decode`` returns a fresh ``bytes`` payload."""

    sealed = True
    header_size = _SEALED_HEADER.size
    TAG = 16

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError(f"{KEY_FIELD}: an AES-256 key is 32 bytes, got {len(key)}")
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)

    def frame_size(self, payload_len: int) -> int:
        return _SEALED_HEADER.size + payload_len + self.TAG

    @staticmethod
    def _aad(key: bytes) -> bytes:
        return SEALED_MAGIC + _KEY_LEN.pack(len(key)) + key

    def encode(self, key: bytes, data: bytes | memoryview) -> bytes:
        nonce = os.urandom(12)  # random per write: 2^-32 collision odds only after ~2^32 writes per key
        sealed = self._aead.encrypt(nonce, data, self._aad(key))
        return _SEALED_HEADER.pack(SEALED_MAGIC, nonce, len(sealed)) + sealed

    def decode(self, key: bytes, blob: bytes | memoryview | None) -> bytes | None:
        """The payload, or None when the frame is not a sealed frame of this key written with
        this encryption key (truncated, altered, swapped, plain, or another encryption key)."""
        if blob is None or len(blob) < _SEALED_HEADER.size + self.TAG:
            return None
        magic, nonce, n = _SEALED_HEADER.unpack_from(blob)
        sealed = memoryview(blob)[_SEALED_HEADER.size:]
        if magic != SEALED_MAGIC or n != len(sealed):
            return None
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(nonce, sealed, self._aad(key))
        except InvalidTag:
            return None


Codec = PlainCodec | SealedCodec | DigestCodec
PLAIN = PlainCodec()


def encode(key: bytes, data: bytes | memoryview) -> bytes:
    """A plain frame of ``data`` bound to ``key``."""
    return PLAIN.encode(key, data)


def encode_into(dst: memoryview, key: bytes, data: bytes | memoryview) -> None:
    PLAIN.encode_into(dst, key, data)


def decode(key: bytes, blob: bytes | memoryview | None) -> memoryview | None:
    """The payload of a plain frame stored under ``key``, or None (see ``PlainCodec.decode``)."""
    return PLAIN.decode(key, blob)


def load_key_file(path: str | os.PathLike) -> bytes:
    """The 32-byte key in ``path``: exactly 32 raw bytes, or 64 hex digits (surrounding
    whitespace allowed). Anything else raises ValueError naming ``tier_encryption_key_file``;
    a file that group or others may read or write is accepted with a warning."""
    p = Path(path)
    try:
        st = p.stat()
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"{KEY_FIELD}: cannot read {str(p)!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{KEY_FIELD}: {str(p)!r} is not a regular file")
    if st.st_mode & 0o077:
        warnings.warn(f"{KEY_FIELD}: {str(p)!r} is accessible to group or others (mode "
                      f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it", stacklevel=2)
    if len(raw) == 32:
        return raw
    text = raw.strip()
    if len(text) == 64:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise ValueError(f"{KEY_FIELD}: {str(p)!r} must hold a 32-byte key, as 32 raw bytes or 64 hex "
                     f"digits; it holds {len(raw)} bytes")


def sealed_codec_from_file(path: str | os.PathLike | None) -> Codec:
    """The codec of the disk and Redis tiers: sealed with the key in ``path``, else plain."""
    return PLAIN if path is None else SealedCodec(load_key_file(path))
