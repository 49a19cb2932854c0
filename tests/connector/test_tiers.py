"""Tiers below the device: CPU memory, local disk and a real Redis server."""
from __future__ import annotations

import pytest

from kvos import SamplingParams
from kvos.cache.tiers import (
    CPUTier,
    DiskTier,
    RedisTier,
    SlotArena,
    TierHierarchy,
    decode,
)
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow

# A few tokens a turn: what is tested is the prefix each later turn loads from a tier, and the
# first token after a load already reads all of it (every engine step costs ~0.4 s on CPU).
SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SYSTEM = "You are a helpful assistant who explains operating-system memory management. " * 6
QUESTIONS = ["What is paging?", "What is a TLB?", "Explain swapping."]


@pytest.fixture(scope="module")
def redis_server():
    r = RedisServer()
    yield r
    r.stop()


def flood(llm, n: int = 2) -> None:
    """Push the conversation's blocks out of a small device pool: two fillers of 19 blocks each
    (the 24-block pools here hold 23), so nothing older survives on the device."""
    for i in range(n):
        llm.generate([f"unrelated filler text {i} " * 60], SamplingParams(max_tokens=1), use_tqdm=False)


def chat_turns(llm, evict: bool) -> list:
    msgs = [{"role": "system", "content": SYSTEM}]
    outs = []
    for q in QUESTIONS:
        msgs = msgs + [{"role": "user", "content": q}]
        o = llm.chat(msgs, SP, use_tqdm=False)[0]
        outs.append(o)
        msgs = msgs + [{"role": "assistant", "content": o.outputs[0].text}]
        if evict:
            flood(llm)
    return outs


@pytest.fixture(scope="module")
def reference(make_llm):
    return [o.outputs[0].token_ids for o in chat_turns(make_llm(enable_prefix_caching=False), evict=False)]


@pytest.mark.parametrize("tier", ["cpu", "cpu-device-verify", "disk", "remote"])
def test_later_turns_hit_in_each_tier_with_identical_output(tier, make_llm, reference, tmp_path, redis_server):
    kw = {"cpu": dict(cpu_cache_gb=1.0), "cpu-device-verify": dict(cpu_cache_gb=1.0, tier_verify="device"),
          "disk": dict(disk_cache_dir=str(tmp_path)), "remote": dict(remote_cache=redis_server.url)}[tier]
    tier = tier.removesuffix("-device-verify")
    llm = make_llm(num_blocks=24, **kw)
    outs = chat_turns(llm, evict=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    for o in outs[1:]:
        src = o.metrics["cached_tokens_by_source"]
        assert src.get(tier, 0) > 0, src
        assert o.num_cached_tokens == sum(src.values())
    stats = {t["name"]: t for t in llm.stats()["tiers"]}
    assert stats[tier]["hits_blocks"] > 0 and stats[tier]["stores_bytes"] > 0 and stats[tier]["store_seconds"] > 0
    assert llm.stats()["used"] == 0
    from prometheus_client import generate_latest

    from kvos.serve.metrics import ServerMetrics

    text = generate_latest(ServerMetrics(llm.engine.stats).registry).decode()
    assert f'kvos:tier_hit_blocks_total{{tier="{tier}"}}' in text and "kvos:tier_hit_tokens_total" in text


@pytest.mark.parametrize("verify", ["host", "device"])
def test_write_back_demotes_through_the_tiers(verify, make_llm, reference, tmp_path):
    llm = make_llm(num_blocks=24, cpu_cache_gb=0.01, disk_cache_dir=str(tmp_path), write_policy="write_back",
                   tier_verify=verify)
    outs = chat_turns(llm, evict=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = {t["name"]: t for t in llm.stats()["tiers"]}
    assert stats["cpu"]["stores_blocks"] > 0 and stats["cpu"]["evictions"] > 0
    assert stats["disk"]["stores_blocks"] > 0  # only what the CPU tier evicted
    assert sum(o.num_cached_tokens for o in outs[1:]) > 0


def test_corrupt_disk_block_is_detected_and_recomputed(make_llm, reference, tmp_path):
    llm = make_llm(num_blocks=24, disk_cache_dir=str(tmp_path))
    chat_turns(llm, evict=True)
    files = sorted(tmp_path.glob("*.kv"))
    assert files
    for f in files:  # corrupt every stored block
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    flood(llm)
    outs = chat_turns(llm, evict=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    disk = next(t for t in llm.stats()["tiers"] if t["name"] == "disk")
    assert disk["checksum_failures"] > 0


def test_corrupt_cpu_block_checked_on_the_device_is_recomputed(make_llm, reference):
    """Digest frames (``tier_verify="device"``): a CPU-tier block whose bytes changed after the
    store is copied, fails its digest, is dropped and recomputed; the outputs do not change."""
    llm = make_llm(num_blocks=24, cpu_cache_gb=1.0, tier_verify="device")
    chat_turns(llm, evict=True)
    cpu = next(t for t in llm.engine.offload.h.tiers if t.name == "cpu")
    assert cpu.digests
    keys = list(cpu.arena._lru)
    for key in keys:
        cpu.corrupt(key)
    flood(llm)
    outs = chat_turns(llm, evict=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = next(t for t in llm.stats()["tiers"] if t["name"] == "cpu")
    assert stats["checksum_failures"] > 0


def test_disk_hits_survive_an_engine_restart(make_llm, reference, tmp_path):
    first = make_llm(num_blocks=24, disk_cache_dir=str(tmp_path))
    chat_turns(first, evict=True)
    first.engine.offload.close()
    second = make_llm(num_blocks=24, disk_cache_dir=str(tmp_path))
    outs = chat_turns(second, evict=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert outs[0].metrics["cached_tokens_by_source"].get("disk", 0) > 0  # the very first turn hits


def test_two_engines_share_one_redis(make_llm, redis_server, reference):
    a = make_llm(num_blocks=64, remote_cache=redis_server.url)
    chat_turns(a, evict=False)
    a.engine.offload.close()
    b = make_llm(num_blocks=64, remote_cache=redis_server.url)
    outs = chat_turns(b, evict=False)
    assert outs[0].metrics["cached_tokens_by_source"].get("remote", 0) > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_redis_down_is_skipped_counted_and_retried(make_llm, reference):
    server = RedisServer()
    llm = make_llm(num_blocks=24, remote_cache=server.url)
    remote = llm.engine.offload.h.tiers[0]
    remote.retry_after_s = 0.2
    server.stop()
    outs = chat_turns(llm, evict=True)  # every request completes without the tier
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert remote.stats.errors > 0
    server.start()
    import time

    time.sleep(0.3)
    outs = chat_turns(llm, evict=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert remote.stats.stores_blocks > 0  # the tier came back
    server.stop()


def test_tier_units(tmp_path):
    cpu = CPUTier(5000)
    assert cpu.put(b"a" * 16, b"x" * 1000) and bytes(cpu.get(b"a" * 16)) == b"x" * 1000
    cpu.corrupt(b"a" * 16)
    assert cpu.get(b"a" * 16) is None and cpu.stats.checksum_failures == 1 and not cpu.contains(b"a" * 16)
    disk = DiskTier(tmp_path, 2500)
    for i in range(4):
        disk.put(bytes([i]) * 16, bytes([i]) * 1000)
    assert disk.stats.evictions == 2 and len(list(tmp_path.glob("*.kv"))) == 2
    (tmp_path / "junk.kv.123.tmp").write_bytes(b"torn")
    again = DiskTier(tmp_path, 2500)  # index rebuilt, torn temp files removed
    assert bytes(again.get(bytes([3]) * 16)) == bytes([3]) * 1000 and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="remote_cache"):
        RedisTier("http://nope")
    with pytest.raises(ValueError, match="write_policy"):
        TierHierarchy([cpu], "write_around")
    dead = RedisTier("redis://127.0.0.1:1/0", timeout_s=0.1)
    assert dead.put(b"k" * 16, b"v") is False and dead.get(b"k" * 16) is None and dead.stats.errors >= 1


def test_slot_arena_lru_reuse_capacity_and_lazy_growth():
    calls = []

    def allocate(n: int) -> memoryview:
        calls.append(n)
        return memoryview(bytearray(n))

    arena = SlotArena(100, capacity_bytes=5 * 128, allocate=allocate, chunk_bytes=2 * 128)
    assert (arena.stride, arena.capacity_slots, calls) == (128, 5, [])  # nothing reserved yet
    keys = [bytes([i]) * 16 for i in range(6)]
    slots = []
    for i in range(5):
        slot = arena.alloc()
        arena.view(slot)[:] = bytes([i]) * 100
        arena.bind(keys[i], slot)
        slots.append(slot)
    assert calls == [256, 256, 128] and arena.reserved_bytes == 640  # grown a chunk at a time, capped
    assert sorted(slots) == list(range(5)) and arena.alloc() is None
    assert all(bytes(arena.view(s)) == bytes([i]) * 100 for i, s in enumerate(slots))  # no overlap
    assert arena.lookup(keys[0]) == slots[0]  # now the most recently used
    assert arena.evict() == (keys[1], slots[1])
    arena.bind(keys[5], slots[1])  # an evicted slot is reused as is
    arena.drop(keys[2])
    assert keys[2] not in arena and arena.alloc() == slots[2]  # a dropped slot is free again
    assert len(calls) == 3 and len(arena) == 4
    with pytest.raises(ValueError, match="holds no slot"):
        SlotArena(100, capacity_bytes=64)


def test_cpu_tier_slots_evict_in_lru_order_and_skip_larger_payloads():
    cpu = CPUTier(3 * 1088)  # three slots: 64 bytes of alignment and header + 1000, rounded to 64
    keys = [bytes([i]) * 16 for i in range(5)]
    evicted = []

    class Evictions:
        def frame_evicted(self, tier, key, frame) -> None:
            evicted.append((key, bytes(decode(key, frame))))

    cpu.add_eviction_listener(Evictions())
    for i in range(3):
        assert cpu.put(keys[i], bytes([i]) * 1000)
    assert cpu.get(keys[0]) is not None  # keys[1] is now the least recently used
    assert cpu.put(keys[3], b"\x03" * 1000)
    assert evicted == [(keys[1], b"\x01" * 1000)] and not cpu.contains(keys[1])  # seen before reuse
    assert bytes(cpu.get(keys[3])) == b"\x03" * 1000 and bytes(cpu.get(keys[0])) == b"\x00" * 1000
    assert cpu.arena.reserved_bytes == 3 * 1088 and cpu.used_bytes() == 3 * 1088
    assert not cpu.put(keys[4], b"x" * 1001) and cpu.stats.skipped_writes == 1  # slot size is fixed
    cpu.corrupt(keys[3])
    assert cpu.get(keys[3]) is None and cpu.stats.checksum_failures == 1 and cpu.used_bytes() == 2 * 1088
    assert cpu.put(keys[4], b"\x04" * 1000) and len(cpu.arena.chunks) == 1  # the freed slot, no growth
    tiny = CPUTier(1000)
    assert not tiny.put(keys[0], b"x" * 1000) and tiny.stats.skipped_writes == 1


def test_cpu_tier_slots_hold_smaller_payloads_of_other_cache_groups():
    """Slots are sized for the largest group's block; a smaller one is framed at its own length."""
    cpu = CPUTier(3 * 1088)
    cpu.size_slots(1000)
    keys = [bytes([i]) * 16 for i in range(3)]
    assert cpu.put(keys[0], b"\x01" * 10) and cpu.put(keys[1], b"\x02" * 1000)
    assert bytes(cpu.get(keys[0])) == b"\x01" * 10 and bytes(cpu.get(keys[1])) == b"\x02" * 1000
    slot, payload = cpu.reserve(keys[2], 300)
    assert len(payload) == 300
    payload[:] = b"\x03" * 300
    cpu.commit(keys[2], slot)
    assert bytes(cpu.get(keys[2])) == b"\x03" * 300 and cpu.stats.checksum_failures == 0
    cpu.corrupt(keys[0])
    assert cpu.get(keys[0]) is None and cpu.stats.checksum_failures == 1


def kv_runner(num_blocks: int = 10):
    """A ModelRunner with only a random KV tensor (what the tier path touches)."""
    import torch

    from kvos.worker.runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.dtype = torch.device("cpu"), torch.float32
    runner.group_caches = [torch.randn(num_blocks, 2, 2, 4, 2, 8)]  # page-major: [blocks, layers, K/V, ...]
    runner.group_pages = [runner.group_caches[0].view(num_blocks, -1).view(torch.uint8)]
    return runner


@pytest.mark.parametrize("digests", [False, True], ids=["host-verify", "device-verify"])
def test_batched_load_copies_before_promotions_evict_slots(digests, tmp_path):
    """One fetch takes its first blocks from CPU slots and the rest from disk, verified on three
    threads; promoting the disk hits evicts those very slots, which must happen only after
    their bytes were copied out (and every find has ended). With digest frames the CPU blocks
    are checked after their copy, and promoted disk blocks get their digests from the copy."""
    import torch

    from kvos.connector.tier_io import TierIO, host_digest

    runner = kv_runner()
    bb = runner.block_bytes
    cpu = CPUTier(2 * (bb + 128), digest_fn=host_digest if digests else None)
    disk = DiskTier(tmp_path, 1 << 20)
    tio = TierIO(TierHierarchy([cpu, disk]), runner, verify_threads=3)
    assert tio.digests == digests
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    # stored in the order 3, 4, 1, 2: the CPU tier keeps the last two, blocks 1 and 2
    d: list[int] = []
    rows = runner.read_blocks([3, 4, 1, 2], d)
    tio.store([keys[2], keys[3], keys[0], keys[1]], rows, evicted=False, digests=d if digests else None)
    assert [cpu.contains(k) for k in keys] == [True, True, False, False]
    expected = runner.group_caches[0][1:5].clone()
    loaded = tio.fetch(keys)
    assert loaded.sources == ["cpu", "cpu", "disk", "disk"] and loaded.rows.shape == (4, bb)
    assert [cpu.contains(k) for k in keys] == [False, False, True, True]  # promoted afterwards
    tio.install(loaded, [6, 7, 8, 9])
    assert torch.equal(runner.group_caches[0][6:10], expected)
    cpu.corrupt(keys[2])  # a bad CPU copy falls through to the disk copy (checked on the host)
    if digests:  # or is dropped after its copy (checked there): the load stops before it
        assert tio.fetch(keys[2:3]).sources == [] and not cpu.contains(keys[2])
        assert tio.fetch(keys[2:3]).sources == ["disk"]
    else:
        assert tio.fetch(keys[2:3]).sources == ["disk"]
    assert cpu.stats.checksum_failures == 1
    partial = tio.fetch([keys[2], b"?" * 16, keys[3]])  # stops at the first miss
    assert partial.sources == ["cpu"] and partial.rows.shape == (1, bb)
    empty = TierIO(TierHierarchy([CPUTier(1 << 20)]), runner)
    assert empty.fetch(keys).sources == []
    empty.close()
    hits = cpu.stats.hits_blocks
    for _ in range(20):  # counters stay exact with concurrent finds
        assert tio.fetch(keys[2:]).sources == ["cpu", "cpu"]
    assert cpu.stats.hits_blocks == hits + 40
    tio.close()


def test_loads_mixing_tiers_in_one_batch_are_token_identical(make_llm, reference, tmp_path):
    """The CPU tier is just too small for a conversation and the fillers: a later turn's prefix
    comes partly from disk (promoted into CPU slots, evicting others) and partly from CPU slots,
    in one load."""
    llm = make_llm(num_blocks=24, cpu_cache_gb=0.027, disk_cache_dir=str(tmp_path))
    outs = chat_turns(llm, evict=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    sources = [o.metrics["cached_tokens_by_source"] for o in outs[1:]]
    assert any(src.get("cpu", 0) and src.get("disk", 0) for src in sources), sources
    assert next(t for t in llm.stats()["tiers"] if t["name"] == "cpu")["evictions"] > 0


def test_tier_bandwidth_bench_runs_the_load_path_on_cpu(tmp_path):
    import argparse

    from kvos.bench.tier_bandwidth import add_args, run

    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args(["--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                      "--block-size", "4", "--blocks", "8", "--repeats", "2", "--output", str(tmp_path / "b.json")])
    result = run(a)
    assert result["verified"] and result["tier_load_GBps"] > 0 and result["checksum_GBps"] > 0


def test_hash_root_is_the_model_content_not_its_name(llm, tmp_path):
    """Two different checkpoints both named model.gguf get different hash roots (they never share
    a block in a shared Redis or a persistent disk tier); a renamed byte-identical copy gets the
    same root (it may)."""
    import shutil

    from kvos.cache.hashing import root_hash
    from kvos.models.fingerprint import model_fingerprint
    from kvos.models.loader import default_model_path

    src = default_model_path()
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for p in (a, b):
        p.parent.mkdir()
        shutil.copyfile(src, p)
    with open(b, "r+b") as f:  # one byte of the last tensor's data
        f.seek(-7, 2)
        byte = f.read(1)
        f.seek(-7, 2)
        f.write(bytes([byte[0] ^ 1]))
    root = {p: root_hash(model_fingerprint(p, "float32")) for p in (src, a, b)}
    assert root[a] == root[src] and root[b] != root[a]
    assert llm.engine.kv.model_id == model_fingerprint(src, "float32")
    assert model_fingerprint(src, "float32") != model_fingerprint(src, "bfloat16")  # the KV dtype too


def test_cpu_tier_preallocates_every_slot_once_sized():
    """On a GPU the engine pins the whole tier at start: the slot size fixed, every slot there,
    none bound; later puts reuse them (no growth) and a payload of another size is skipped."""
    tier = CPUTier(10 * 4096)
    reserved = tier.preallocate(1000)
    arena = tier.arena
    assert reserved == arena.capacity_slots * arena.stride and len(arena.chunks) >= 1
    assert tier.free_slots() == arena.capacity_slots and tier.used_bytes() == 0
    assert tier.preallocate(1000) == reserved  # sized already: nothing more
    for i in range(arena.capacity_slots + 2):
        assert tier.put(bytes([i]) * 16, bytes(1000))
    assert arena.reserved_bytes == reserved and tier.stats.evictions == 2
    assert not tier.put(b"x" * 16, bytes(1001)) and tier.stats.skipped_writes == 1  # larger than a slot
    assert CPUTier(100).preallocate(1000) == 0  # not one slot fits


def test_cpu_tier_grows_in_the_background_while_it_stores():
    """``preallocate(background=True)``: a thread adds the chunks (slowly, outside the lock) while
    puts go on; until it is done the tier stores into the slots it has and evicts rather than
    growing itself, it never holds more than its capacity, and it ends with every slot."""
    import threading

    from kvos.cache.tiers import allocate_bytearray

    gate = threading.Event()
    calls = []

    def slow(nbytes: int) -> memoryview:
        calls.append(nbytes)
        if len(calls) == 2:
            assert gate.wait(30)  # the second chunk arrives only when the test says so
        return allocate_bytearray(nbytes)

    tier = CPUTier(40 * 1088, slow, chunk_bytes=10 * 1088)  # 40 slots of 1,088 bytes, 10 a chunk
    assert tier.preallocate(1000, background=True) == 0
    for _ in range(200):  # the first chunk lands
        if tier.arena.chunks:
            break
        threading.Event().wait(0.01)
    assert len(tier.arena.chunks) == 1 and not tier.preallocated.is_set()
    for i in range(15):  # 10 slots so far: the last 5 puts evict, none grows the arena
        assert tier.put(bytes([i]) * 16, bytes([i]) * 1000)
    assert len(tier.arena.chunks) == 1 and tier.stats.evictions == 5 and len(calls) == 2
    gate.set()
    assert tier.preallocated.wait(30)
    assert tier.arena.reserved_bytes == 40 * 1088 and tier.free_slots() == 30 and len(calls) == 4
    assert bytes(tier.get(bytes([14]) * 16)) == bytes([14]) * 1000
    for i in range(15, 45):  # room for 30 more before the next eviction
        tier.put(bytes([i]) * 16, bytes(1000))
    assert tier.stats.evictions == 5 and tier.free_slots() == 0
    gate2 = threading.Event()
    empty = CPUTier(10 * 1088, lambda n: (gate2.wait(30), allocate_bytearray(n))[1], chunk_bytes=10 * 1088)
    empty.preallocate(1000, background=True)
    assert not empty.put(b"k" * 16, bytes(1000)) and empty.stats.skipped_writes == 1  # no slot yet: skipped
    assert empty.reserve(b"k" * 16, 1000) is None and empty.reserve(b"k" * 16, 1000, evict_wanted=False) is False
    gate2.set()
    assert empty.preallocated.wait(30) and empty.put(b"k" * 16, bytes(1000))
