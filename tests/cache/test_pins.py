"""Pinned prefixes: pinned blocks survive memory pressure under every policy (a property over
random workloads on the real scheduler and KV manager), expire, respect their cap, and change no
token of the real model's output."""
from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvos import SamplingParams
from kvos.cache.eviction import online_policies
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.pins import PinnedPrefixes
from kvos.cache.spec import FullAttentionSpec
from kvos.core.request import Request
from kvos.scheduler.scheduler import Scheduler, SchedulerConfig

POLICIES_UNDER_TEST = online_policies()


def drain(sched: Scheduler) -> None:
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, {t.request_id: 7 for s in out.seqs for t in s.samplers})


@settings(max_examples=40, deadline=None)
@given(policy=st.sampled_from(POLICIES_UNDER_TEST), seed=st.integers(0, 2**16), num_blocks=st.integers(12, 40),
       lookahead=st.sampled_from([0, 4]))
def test_pinned_blocks_survive_pressure(policy, seed, num_blocks, lookahead):
    rng = random.Random(seed)
    kv = KVCacheManager(FullAttentionSpec(4, 1, 1, 1), num_blocks, "m", policy=policy)
    sched = Scheduler(SchedulerConfig(32, 3, eviction_lookahead=lookahead), kv)
    pins = PinnedPrefixes(kv, max_fraction=0.5)
    system = [rng.randrange(1000) for _ in range(12)]
    sched.add_request(Request("warm", system + [1], SamplingParams(max_tokens=1, ignore_eos=True)))
    drain(sched)
    pin = pins.pin("p", system, None, now=0.0, ttl_s=None)
    assert pin.num_tokens == 12 and all(b.ref_cnt >= 1 for b in pin.blocks)
    hashes = [b.block_hash for b in pin.blocks]
    for i in range(rng.randint(5, 15)):  # unrelated traffic: evicts everything else
        n = rng.randint(4, (num_blocks - 4) * 2)
        sched.add_request(Request(f"r{i}", [rng.randrange(1000, 2000) for _ in range(n)],
                                  SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True)))
        if rng.random() < 0.5:
            drain(sched)
    drain(sched)
    assert [b.block_hash for b in pin.blocks] == hashes  # never evicted, never overwritten
    reader = Request("reader", system + [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add_request(reader)
    drain(sched)
    assert reader.num_cached_tokens == 12
    assert pins.unpin("p") and not pins.unpin("p")
    u = kv.usage()
    assert u.used == 0 and u.total == u.free + u.cached


def test_pin_cap_and_expiry():
    kv = KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 11, "m")  # 10 usable blocks: the cap is 3
    sched = Scheduler(SchedulerConfig(64, 2), kv)
    pins = PinnedPrefixes(kv, max_fraction=0.3)
    a, b = list(range(8)), list(range(100, 108))
    for i, p in enumerate((a, b)):
        sched.add_request(Request(f"w{i}", p + [1], SamplingParams(max_tokens=1, ignore_eos=True)))
    drain(sched)
    pins.pin("a", a, None, now=0.0, ttl_s=5.0)  # 2 blocks
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        pins.pin("b", b, None, now=0.0, ttl_s=None)  # 4 > 3
    with pytest.raises(ValueError, match="cached"):
        pins.pin("c", list(range(200, 208)), None, now=0.0, ttl_s=None)  # never computed
    assert pins.expire(now=4.9) == [] and pins.num_pinned_blocks == 2
    assert pins.expire(now=5.0) == ["a"] and pins.num_pinned_blocks == 0
    pins.pin("b", b, None, now=6.0, ttl_s=None)  # room again
    assert kv.usage().used == 2


def test_engine_pin_keeps_a_system_prompt_and_changes_no_token(llm, make_llm):
    system = "You keep the logbook of a lighthouse. Answer in one short sentence, with times in 24-hour form. " * 2
    question = system + "When is high tide today?"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate([question], params, use_tqdm=False)[0].outputs[0].token_ids
    flood = [f"Entry {i}: the wind turned {i} points north and the harbour filled with fishing boats. " * 4
             for i in range(6)]
    small = make_llm(num_blocks=16, block_size=16)
    pin = small.pin_prefix(system, ttl_s=600)
    assert pin["pinned_tokens"] >= 32 and pin["expires_at"] > time.monotonic()
    evictions = small.engine.kv.counters.evictions
    small.generate(flood, params, use_tqdm=False)
    assert small.engine.kv.counters.evictions > evictions
    out = small.generate([question], params, use_tqdm=False)[0]
    assert out.num_cached_tokens >= pin["pinned_tokens"]
    assert out.outputs[0].token_ids == ref
    assert small.unpin_prefix(pin["pin_id"])
    small.generate(flood, params, use_tqdm=False)
    assert small.generate([question], params, use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="ttl_s"):
        small.pin_prefix(system, ttl_s=0)
