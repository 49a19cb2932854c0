"""The CPU tier's digest frames: ``block_digests`` against a plain-Python reference, what it
detects, and ``DigestCodec`` framing."""
from __future__ import annotations

import random

import pytest
import torch

from kvos.cache.tiers import DigestCodec, PlainCodec
from kvos.connector.tier_io import host_digest
from kvos.worker.block_digest import _multipliers, block_digests

MASK = (1 << 64) - 1


def reference_digest(row: bytes) -> int:
    """Sum of little-endian 64-bit words times their multipliers, modulo 2**64, as a signed int."""
    m = _multipliers(len(row) // 8, torch.device("cpu")).tolist()
    total = sum(int.from_bytes(row[8 * i: 8 * i + 8], "little") * (m[i] & MASK) for i in range(len(m))) & MASK
    return total - (1 << 64) if total >> 63 else total


@pytest.mark.parametrize("block_bytes", [8, 64, 4096, 24 * 1024])
def test_digest_matches_the_reference(block_bytes):
    rows = torch.randint(0, 256, (5, block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got = block_digests(rows).tolist()
    assert got == [reference_digest(bytes(r.numpy())) for r in rows]
    assert host_digest(memoryview(rows[2].numpy())) == got[2]


def test_digest_is_chunked_exactly(monkeypatch):
    import kvos.worker.block_digest as bd

    rows = torch.randint(0, 256, (9, 512), dtype=torch.uint8)
    whole = block_digests(rows).tolist()
    monkeypatch.setattr(bd, "CHUNK_BYTES", 1024)  # two rows per launch
    assert block_digests(rows).tolist() == whole


def test_digest_detects_flips_moves_and_zeroing():
    rng = random.Random(0)
    row = torch.randint(0, 256, (1, 4096), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    base = block_digests(row)[0].item()
    for _ in range(200):  # any single-bit flip
        pos, bit = rng.randrange(4096), rng.randrange(8)
        bad = row.clone()
        bad[0, pos] ^= 1 << bit
        assert block_digests(bad)[0].item() != base, (pos, bit)
    words = row.view(torch.int64).clone()
    words[0, [3, 7]] = words[0, [7, 3]]  # two words trade places
    if not torch.equal(words, row.view(torch.int64)):
        assert block_digests(words.view(torch.uint8))[0].item() != base
    assert block_digests(torch.zeros_like(row))[0].item() == 0 != base
    with pytest.raises(ValueError, match="64-bit words"):
        block_digests(torch.zeros(1, 12, dtype=torch.uint8))


def test_digest_codec_binds_the_key():
    codec = DigestCodec(host_digest)
    data = bytes(range(256)) * 4
    k1, k2 = b"\x01" * 16, b"\x02" * 16
    frame = codec.encode(k1, data)
    assert bytes(codec.decode(k1, frame)) == data
    payload, expect = codec.split(k1, frame)
    assert bytes(payload) == data and expect == host_digest(data)
    assert codec.decode(k2, frame) is None  # another key's frame
    assert codec.split(k2, frame)[1] != host_digest(data)
    assert codec.split(k1, frame[:-1]) is None and codec.decode(k1, frame[:10]) is None  # truncated
    assert codec.split(k1, PlainCodec().encode(k1, data)) is None  # a plain frame
    assert PlainCodec().decode(k1, frame) is None
    bad = bytearray(frame)
    bad[-1] ^= 1
    assert codec.decode(k1, bytes(bad)) is None
    assert codec.encode(k1, data, digest=host_digest(data)) == frame  # the caller's digest
