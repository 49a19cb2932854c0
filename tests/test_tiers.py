"""Tiers below the device: CPU memory, local disk and a real Redis server."""
from __future__ import annotations

import pytest

from kvos import SamplingParams
from kvos.cache.tiers import CPUTier, DiskTier, RedisTier, TierHierarchy
from tests.redis_server import RedisServer

SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = "You are a helpful assistant who explains operating-system memory management. " * 6
QUESTIONS = ["What is paging?", "What is a TLB?", "Explain swapping."]


@pytest.fixture(scope="module")
def redis_server():
    r = RedisServer()
    yield r
    r.stop()


def flood(llm, n: int = 3) -> None:
    """Push the conversation's blocks out of a small device pool."""
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


@pytest.mark.parametrize("tier", ["cpu", "disk", "remote"])
def test_later_turns_hit_in_each_tier_with_identical_output(tier, make_llm, reference, tmp_path, redis_server):
    kw = {"cpu": dict(cpu_cache_gb=1.0), "disk": dict(disk_cache_dir=str(tmp_path)),
          "remote": dict(remote_cache=redis_server.url)}[tier]
    llm = make_llm(num_blocks=24, **kw)
    outs = chat_turns(llm, evict=True)
    assert [o.outputs[0].token_ids for o in outs] == reference
    for o in outs[1:]:
        src = o.metrics["cached_tokens_by_source"]
        assert src.get(tier, 0) > 0, src
        assert o.num_cached_tokens == sum(src.values())
    stats = {t["name"]: t for t in llm.stats()["tiers"]}
    assert stats[tier]["hits_blocks"] > 0 and stats[tier]["stores_bytes"] > 0
    assert llm.stats()["used"] == 0
    from prometheus_client import generate_latest

    from kvos.serve.metrics import ServerMetrics

    text = generate_latest(ServerMetrics(llm.engine.stats).registry).decode()
    assert f'kvos:tier_hit_blocks_total{{tier="{tier}"}}' in text and "kvos:tier_hit_tokens_total" in text


def test_write_back_demotes_through_the_tiers(make_llm, reference, tmp_path):
    llm = make_llm(num_blocks=24, cpu_cache_gb=0.01, disk_cache_dir=str(tmp_path), write_policy="write_back")
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
