"""Tiers at rest (issue #14, items 2, 3 and 11b): blocks are bound to the key they are stored
under, disk files are private, the disk and Redis tiers can be encrypted, and a block file
deleted under a running server is forgotten."""
from __future__ import annotations

import os
import shutil
import stat
import warnings

import pytest
import redis

from kvos import SamplingParams
from kvos.cache.tiers import (
    CPUTier,
    DiskTier,
    RedisTier,
    SealedCodec,
    TierHierarchy,
    decode,
    encode,
)
from kvos.cache.tiers.codec import HEADER_SIZE, checksum, load_key_file
from tests.support.redis_server import RedisServer

K1, K2, K3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
SECRET = b"the user's prompt KV, never in plaintext at rest " * 40
OTHER = (b"another block's KV, valid on its own " * 60)[:len(SECRET)]  # same size: same CPU slot size
KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))


@pytest.fixture(scope="module")
def redis_server():
    r = RedisServer()
    yield r
    r.stop()


@pytest.fixture
def rclient(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


def key_file(tmp_path, content: bytes | str, mode: int = 0o600, name: str = "tier.key") -> str:
    p = tmp_path / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    p.chmod(mode)
    return str(p)


def disk_file(tier: DiskTier, key: bytes):
    return tier.dir / f"{key.hex()}{DiskTier.SUFFIX}"


# -- item 2: a valid block under another block's key is a counted miss --------------------------

def test_frames_are_bound_to_their_key():
    frame = encode(K1, SECRET)
    assert bytes(decode(K1, frame)) == SECRET
    assert decode(K2, frame) is None  # a valid frame, but not this key's
    assert checksum(SECRET, K1) != checksum(SECRET, K2) != checksum(SECRET)
    assert checksum(b"\x01" + SECRET, K1[:-1]) != checksum(SECRET, K1)  # the key's length is hashed in
    old = b"KVOS2" + frame[5:]  # the previous format (payload-only checksum) is rejected
    assert decode(K1, old) is None and decode(K1, frame[:-1]) is None and decode(K1, None) is None


def test_disk_block_copied_over_another_is_a_counted_miss(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    assert disk.put(K1, SECRET) and disk.put(K2, OTHER)
    shutil.copyfile(disk_file(disk, K1), disk_file(disk, K2))
    assert disk.get(K2) is None and disk.stats.checksum_failures == 1
    assert not disk.contains(K2) and not disk_file(disk, K2).exists()  # dropped: recomputed, then stored again
    assert bytes(disk.get(K1)) == SECRET
    assert disk.put(K2, OTHER) and bytes(disk.get(K2)) == OTHER


def test_redis_value_set_under_another_key_is_a_counted_miss(redis_server, rclient):
    remote = RedisTier(redis_server.url)
    assert remote.put(K1, SECRET) and remote.put(K2, OTHER)
    rclient.set(RedisTier.PREFIX + K2.hex(), rclient.get(RedisTier.PREFIX + K1.hex()))
    assert remote.get(K2) is None and remote.stats.checksum_failures == 1 and not remote.contains(K2)
    assert bytes(remote.get(K1)) == SECRET


def test_write_back_demotion_verifies_the_evicted_frame(tmp_path):
    cpu, disk = CPUTier(2 * (HEADER_SIZE + len(SECRET) + 64)), DiskTier(tmp_path, 1 << 20)
    TierHierarchy([cpu, disk], "write_back")
    cpu.put(K1, SECRET)
    cpu.put(K2, OTHER)
    cpu.corrupt(K2)  # now the most recently used
    cpu.put(K3, OTHER)  # evicts K1, demoted intact
    assert bytes(disk.get(K1)) == SECRET
    cpu.put(b"\x04" * 16, OTHER)  # evicts K2, whose frame no longer verifies: not demoted
    assert not disk.contains(K2) and cpu.stats.checksum_failures == 1


SP = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPTS = ["Paging splits memory into fixed-size pages that the kernel maps on demand. " * 3,
           "A translation lookaside buffer caches recent virtual-to-physical lookups. " * 3]


def run_swap(llm, stored_keys, swap) -> None:
    """Generate both prompts cold (the reference: no tier held anything), then with the device
    cache empty, swap the second prompt's stored blocks for the first's and generate again: the
    first prompt hits, the second is recomputed and equals its reference."""

    def drain() -> None:  # write-through stores run on the tier I/O thread
        llm.engine.offload.io.submit(lambda: None).result()

    ref = [llm.generate([p], SP, use_tqdm=False)[0] for p in PROMPTS[:1]]
    drain()
    first = stored_keys()
    ref.append(llm.generate(PROMPTS[1:], SP, use_tqdm=False)[0])
    drain()
    second = stored_keys() - first
    assert first and second
    swap(sorted(first), sorted(second))
    llm.reset_prefix_cache()
    outs = [llm.generate([p], SP, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    name = llm.engine.offload.h.tiers[0].name
    assert outs[0].metrics["cached_tokens_by_source"].get(name, 0) > 0
    assert outs[1].metrics["cached_tokens_by_source"].get(name, 0) == 0  # recomputed
    tier = next(t for t in llm.stats()["tiers"] if t["name"] == name)
    assert tier["checksum_failures"] >= 1


def test_engine_recomputes_swapped_disk_blocks(make_llm, tmp_path):
    llm = make_llm(num_blocks=32, disk_cache_dir=str(tmp_path))

    def swap(src, dst):
        for i, name in enumerate(dst):
            shutil.copyfile(tmp_path / src[i % len(src)], tmp_path / name)

    run_swap(llm, lambda: {p.name for p in tmp_path.glob("*.kv")}, swap)
    llm.engine.offload.close()


def test_engine_recomputes_swapped_redis_blocks(make_llm, redis_server, rclient):
    llm = make_llm(num_blocks=32, remote_cache=redis_server.url)

    def swap(src, dst):
        for i, name in enumerate(dst):
            rclient.set(name, rclient.get(src[i % len(src)]))

    run_swap(llm, lambda: set(rclient.keys(RedisTier.PREFIX + "*")), swap)
    llm.engine.offload.close()


# -- item 3: private files, encryption at rest ------------------------------------------------

def test_disk_files_are_0600_in_a_0700_directory_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        disk = DiskTier(tmp_path / "new" / "kv", 1 << 20)
        disk.put(K1, SECRET)
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        with pytest.warns(UserWarning, match="disk_cache_dir"):
            existing = DiskTier(shared, 1 << 20)  # an existing directory is left alone, with a warning
        existing.put(K1, SECRET)
    finally:
        os.umask(old)
    assert stat.S_IMODE(disk.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(disk_file(disk, K1).stat().st_mode) == 0o600
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert stat.S_IMODE(disk_file(existing, K1).stat().st_mode) == 0o600


def test_sealed_disk_tier_hides_payloads_and_binds_keys(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, SealedCodec(KEY_A))
    assert disk.put(K1, memoryview(SECRET)) and disk.put(K2, OTHER)
    raw = disk_file(disk, K1).read_bytes()
    assert SECRET[:32] not in raw and SECRET[-32:] not in raw
    assert disk.get(K1) == SECRET and disk.get(K2) == OTHER  # round trip
    wrong = DiskTier(tmp_path, 1 << 20, SealedCodec(KEY_B))  # restarted with another key: misses, not garbage
    assert wrong.get(K1) is None and wrong.stats.checksum_failures == 1 and not wrong.contains(K1)
    disk = DiskTier(tmp_path, 1 << 20, SealedCodec(KEY_A))
    assert disk.put(K1, SECRET)
    shutil.copyfile(disk_file(disk, K2), disk_file(disk, K1))  # swapped: fails authentication
    assert disk.get(K1) is None and disk.stats.checksum_failures == 1
    disk_file(disk, K3).write_bytes(encode(K3, OTHER))  # a planted plain frame is not accepted
    assert DiskTier(tmp_path, 1 << 20, SealedCodec(KEY_A)).get(K3) is None
    assert DiskTier(tmp_path, 1 << 20).get(K2) is None  # nor is a sealed frame without the key


def test_sealed_frames_of_the_same_block_differ_on_every_write(tmp_path):
    """AES-GCM must never reuse a nonce under one key: two writes of the same block (same key,
    same bytes) give different frames, both of which decrypt."""
    codec = SealedCodec(KEY_A)
    frames = [codec.encode(K1, SECRET) for _ in range(8)]
    assert len(set(frames)) == len(frames)
    nonces = {f[5:17] for f in frames}  # after the 5-byte magic
    assert len(nonces) == len(frames)
    assert all(codec.decode(K1, f) == SECRET for f in frames)
    disk = DiskTier(tmp_path, 1 << 20, codec)  # and through a tier: a rewrite is a new frame
    assert disk.put(K1, SECRET)
    first = disk_file(disk, K1).read_bytes()
    disk_file(disk, K1).unlink()
    disk = DiskTier(tmp_path, 1 << 20, codec)  # reopened: the block is gone and is written again
    assert disk.put(K1, SECRET)
    assert disk_file(disk, K1).read_bytes() != first and disk.get(K1) == SECRET


def test_sealed_redis_tier_hides_payloads_and_binds_keys(redis_server, rclient):
    remote = RedisTier(redis_server.url, codec=SealedCodec(KEY_A))
    assert remote.put(K1, SECRET) and remote.put(K2, OTHER)
    raw = rclient.get(RedisTier.PREFIX + K1.hex())
    assert SECRET[:32] not in raw and SECRET[-32:] not in raw
    assert remote.get(K1) == SECRET
    other_engine = RedisTier(redis_server.url, codec=SealedCodec(KEY_B))
    assert other_engine.get(K2) is None and other_engine.stats.checksum_failures == 1
    assert remote.put(K2, OTHER)
    rclient.set(RedisTier.PREFIX + K2.hex(), raw)
    assert remote.get(K2) is None and remote.stats.checksum_failures == 1


def test_key_file_formats_and_errors_name_the_option(tmp_path):
    from kvos.config import EngineConfig
    from kvos.config.flags import add_engine_args, engine_kwargs

    assert load_key_file(key_file(tmp_path, KEY_A)) == KEY_A
    assert load_key_file(key_file(tmp_path, KEY_A.hex().upper() + "\n")) == KEY_A
    for bad in (b"short", KEY_A + b"\n", "zz" * 32, KEY_A.hex()[:-2]):
        with pytest.raises(ValueError, match="tier_encryption_key_file.*32-byte key"):
            EngineConfig(tier_encryption_key_file=key_file(tmp_path, bad))
    for missing in (str(tmp_path / "absent"), str(tmp_path)):
        with pytest.raises(ValueError, match="tier_encryption_key_file"):
            EngineConfig(tier_encryption_key_file=missing)
    with pytest.warns(UserWarning, match="tier_encryption_key_file.*chmod 600"):
        load_key_file(key_file(tmp_path, KEY_A, mode=0o644))
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    path = key_file(tmp_path, KEY_A)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a 0600 key file gives no warning
        config = EngineConfig(**engine_kwargs(p.parse_args(["--tier-encryption-key-file", path])))
    assert config.tier_encryption_key_file == path


def test_engine_with_a_key_file_seals_disk_blocks(make_llm, tmp_path):
    path = key_file(tmp_path, KEY_A, name="k")
    cache = tmp_path / "kv"
    llm = make_llm(num_blocks=32, disk_cache_dir=str(cache), tier_encryption_key_file=path)
    tier = llm.engine.offload.h.tiers[0]
    assert tier.codec.sealed
    ref = llm.generate(PROMPTS[:1], SP, use_tqdm=False)[0]
    llm.engine.offload.io.submit(lambda: None).result()
    assert all(f.read_bytes()[:5] == b"KVOE1" for f in cache.glob("*.kv"))
    llm.reset_prefix_cache()
    out = llm.generate(PROMPTS[:1], SP, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.metrics["cached_tokens_by_source"].get("disk", 0) > 0
    llm.engine.offload.close()


# -- item 11b: a file deleted under a running tier ----------------------------------------------

def test_deleted_disk_file_is_a_miss_and_leaves_the_index(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    h = TierHierarchy([disk])
    assert disk.put(K1, SECRET) and disk.put(K2, OTHER) and h.lookup([K1, K2]) == 2
    used = disk.used_bytes()
    disk_file(disk, K1).unlink()
    assert h.find(K1) is None and disk.stats.errors == 1 and disk.stats.misses_blocks == 1
    assert not disk.contains(K1) and h.lookup([K1, K2]) == 0 and disk.used_bytes() < used
    disk_file(disk, K2).write_bytes(b"")  # truncated under us: also dropped
    assert disk.get(K2) is None and not disk.contains(K2) and disk.used_bytes() == 0
    assert disk.put(K1, SECRET) and bytes(disk.get(K1)) == SECRET  # stored again
