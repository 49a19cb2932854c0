"""The eviction lookahead's own ordering, deterministically (pure Python): among the cached
prefixes that waiting requests will hit, the one wanted farthest back in the queue goes first,
and a chain's tail before its head; the queue order it reads is the waiting queue's order after
pops and priority inserts, not the heap's array. Each of four one-line breaks fails a test here:
held blocks' ranks reversed, every waiting request given rank 0, the waiting heap's raw array
read instead of its order, a held chain walked root first. (The held heap's depth key is a
tie-break that parking already implies: a parent with a cached child is never evictable.)"""
from __future__ import annotations

import pytest

from kvos.cache.block import KVBlock
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.spec import FullAttentionSpec
from kvos.core.request import Request
from kvos.core.sampling_params import SamplingParams
from kvos.scheduler.scheduler import Scheduler, SchedulerConfig

PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)
BS = 4


class EvictionLog:
    """A pool listener that records each evicted block's (prefix name, depth)."""

    def __init__(self, names: dict[bytes, str]) -> None:
        self.names, self.order = names, []

    def block_cached(self, group: int, block: KVBlock, adopted: bool) -> None:
        pass

    def block_evicting(self, group: int, block: KVBlock) -> None:
        self.order.append((self.names.get(block.block_hash, "?"), block.depth))


def cached_prefixes(lookahead: int) -> tuple[KVCacheManager, Scheduler, dict[str, list[int]], EvictionLog]:
    """A pool of 9 usable blocks holding three cached two-block prefixes X, Y, Z (Z used last) and
    three plain free blocks."""
    kv = KVCacheManager(FullAttentionSpec(BS, 1, 1, 1), 10, "m", policy="lru")
    sched = Scheduler(SchedulerConfig(64, 1, eviction_lookahead=lookahead), kv)
    prefixes = {name: list(range(base, base + 2 * BS)) for name, base in (("X", 100), ("Y", 200), ("Z", 300))}
    for name, toks in prefixes.items():
        run(sched, Request(name, toks + [1], PARAMS))
    names = {}
    for name, toks in prefixes.items():
        probe = Request(f"probe-{name}", toks + [1], PARAMS)
        for h in kv.block_hashes(probe):
            names[h] = name
    log = EvictionLog(names)
    kv.add_listener(log)
    return kv, sched, prefixes, log


def run(sched: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, {t.request_id: 7 for s in out.seqs for t in s.samplers})


def test_the_request_wanted_farthest_back_loses_its_prefix_first_tail_before_head():
    """W1 (queue position 0) will hit X, W2 (position 1) Y; nobody wants Z. A running request
    that needs all six cached blocks evicts Z, then Y's tail and head, then X's: the farthest
    demand first, each chain tail first. (Reversing the ranks, ranking every waiting request 0
    or walking a held chain root first each changes this order.)"""
    kv, sched, p, log = cached_prefixes(lookahead=8)
    big = Request("R", list(range(500, 500 + 9 * BS - 1)), PARAMS)  # 9 blocks: the whole pool
    w1 = Request("W1", p["X"] + [2], PARAMS)  # (arrival order is construction order)
    w2 = Request("W2", p["Y"] + [3], PARAMS)
    sched.add_request(big)  # first in the queue: it runs alone (max_num_seqs=1), W1 and W2 wait
    sched.add_request(w1)
    sched.add_request(w2)
    out = sched.schedule()
    assert [s.request.request_id for s in out.seqs] == ["R"]
    assert [name for name, _ in log.order[:2]] == ["Z", "Z"]
    assert log.order[2:] == [("Y", 1), ("Y", 0), ("X", 1), ("X", 0)]


def test_without_demand_the_policy_alone_evicts_least_recently_used_first():
    """The same pool with the lookahead off: plain LRU takes X (oldest) first, tail first."""
    kv, sched, p, log = cached_prefixes(lookahead=0)
    sched.add_request(Request("R", list(range(500, 500 + 9 * BS - 1)), PARAMS))
    sched.add_request(Request("W1", p["X"] + [2], PARAMS))
    sched.schedule()
    assert [name for name, _ in log.order] == ["X", "X", "Y", "Y", "Z", "Z"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_waiting_head_is_the_queue_order_after_pops_and_inserts(policy):
    """``waiting_head`` returns the next requests in the queue's order (the lookahead's ranks),
    which a heap's array is not, after pops and inserts."""
    kv = KVCacheManager(FullAttentionSpec(BS, 1, 1, 1), 64, "m")
    sched = Scheduler(SchedulerConfig(64, 1, scheduling_policy=policy), kv)
    for i, prio in enumerate([5, 1, 3, 0, 4, 2, 6]):
        sched.add_request(Request(f"r{i}-p{prio}", [10 + i] * 6, PARAMS, priority=prio))
    out = sched.schedule()  # admits the head (max_num_seqs=1)
    first = out.seqs[0].request.request_id
    for i, prio in enumerate([-1, 7]):  # inserts after the pop
        sched.add_request(Request(f"late{i}-p{prio}", [90 + i] * 6, PARAMS, priority=prio))
    head = [r.request_id for r in sched.waiting_head(20)]
    everything = [r for _, r in sorted(sched._waiting, key=lambda kr: kr[0])]
    assert head == [r.request_id for r in everything]
    if policy == "priority":
        assert first == "r3-p0" and head[0] == "late0-p-1" and head[-1] == "late1-p7"
        assert [int(h.rsplit("p", 1)[1]) for h in head] == sorted(int(h.rsplit("p", 1)[1]) for h in head)
    else:
        assert first == "r0-p5" and head[:2] == ["r1-p1", "r2-p3"] and head[-2:] == ["late0-p-1", "late1-p7"]
    assert head != [r.request_id for _, r in sched._waiting]  # the heap's array is another order


def test_a_later_request_extending_an_earlier_ones_hit_keeps_its_own_tail_held():
    """W1 (position 0) hits X's first block, W2 (position 1) all of X. The unwanted prefixes go
    first (Y, then Z: least recently used first), then X's tail (held for W2 only), then X's head
    (held for W1). Walking W2's chain root first would stop at the head W1 already holds and
    leave X's tail to plain LRU, which takes it first (X is the oldest)."""
    kv, sched, p, log = cached_prefixes(lookahead=8)
    big = Request("R", list(range(500, 500 + 9 * BS - 1)), PARAMS)
    w1 = Request("W1", p["X"][:BS] + [2, 2], PARAMS)
    w2 = Request("W2", p["X"] + [3], PARAMS)
    for r in (big, w1, w2):
        sched.add_request(r)
    sched.schedule()
    assert log.order == [("Y", 1), ("Y", 0), ("Z", 1), ("Z", 0), ("X", 1), ("X", 0)]
