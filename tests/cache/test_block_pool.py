"""Unit tests of the free queue, the pool's eviction order and prefix hits."""
from __future__ import annotations

import pytest

from kvos.cache import (
    BlockPool,
    FreeBlockQueue,
    FullAttentionSpec,
    KVBlock,
    KVCacheManager,
)
from tests.support.kv_sequences import Seq, run


def test_free_queue_o1_operations():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.appendleft(blocks[2])
    assert q.popleft() is blocks[2]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2] and len(q) == 5
    with pytest.raises(ValueError):
        q.remove(KVBlock(9))


def test_prefix_hit_never_covers_last_token():
    kv = KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 16, model_id="m")
    a = Seq("a", range(8))
    run(kv, a)
    kv.free(a)
    b = Seq("b", range(8))
    assert run(kv, b) == 4  # 8 tokens cached, but the last one must be computed
    c = Seq("c", range(9))
    assert run(kv, c) == 8


def test_salts_do_not_share_and_same_salt_hits():
    kv = KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 32, model_id="m")
    for rid, salt, expect in [("a", "x", 0), ("b", "y", 0), ("c", "x", 8), ("d", None, 0)]:
        s = Seq(rid, range(9), salt)
        assert run(kv, s) == expect
        kv.free(s)


def test_eviction_prefers_plain_free_then_lru_then_tail_first():
    kv = KVCacheManager(FullAttentionSpec(2, 1, 1, 1), 8, model_id="m")  # 7 usable
    a = Seq("a", [1, 2, 3, 4, 5, 6, 7])  # 4 blocks, 3 full cached
    run(kv, a)
    kv.free(a)
    u = kv.usage()
    assert (u.cached, u.free, u.used) == (3, 4, 0)
    b = Seq("b", [9, 9, 9, 9, 9, 9, 9, 9])  # needs 4: takes the 4 plain free blocks first
    run(kv, b)
    assert kv.counters.evictions == 0
    c = Seq("c", [8, 8])
    run(kv, c)  # must evict one cached block: the tail of a's chain
    assert kv.counters.evictions == 1
    kv.free(b)
    d = Seq("d", [1, 2, 3, 4, 5])
    assert run(kv, d) == 4  # a's first two blocks survived


def test_pool_rejects_double_free_and_tiny_pools():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b])


def test_fork_shares_then_copies_on_write():
    kv = KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 16, model_id="m")
    p = Seq("p", range(6))
    run(kv, p)
    c = Seq("c", range(6))
    c.num_computed_tokens = 6
    kv.fork(p, c)
    assert kv.block_ids("p") == kv.block_ids("c")
    for s in (p, c):
        s.all_token_ids.append(100)
        assert kv.allocate_slots(s, 1)
    copies = kv.take_copies()
    assert len(copies) == 1 and kv.counters.cow_copies == 1
    (p_ids,), (c_ids,) = kv.block_ids("p"), kv.block_ids("c")  # one cache group
    assert p_ids[0] == c_ids[0]  # the full block stays shared
    assert p_ids[1] != c_ids[1]
