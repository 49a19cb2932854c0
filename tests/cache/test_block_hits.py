"""The per-block prefix-hit counter (``KVBlock.num_hits``) and the most-hit prefixes it ranks
(``BlockPool.top_hit_blocks``, ``KVCacheManager.top_prefixes``; what ``kvos top`` lists)."""
from __future__ import annotations

from kvos.cache import FullAttentionSpec, KVCacheManager
from tests.support.kv_sequences import Seq
from tests.support.kv_sequences import run as admit

BS = 4


def serve(kv: KVCacheManager, rid: str, tokens) -> int:
    seq = Seq(rid, tokens)
    n = admit(kv, seq)
    kv.free(seq)
    return n


def hits_of(kv: KVCacheManager, tokens) -> list[int]:
    """The hit counter of each cached full block of ``tokens``' chain, in chain order."""
    hashes = kv.block_hashes(Seq("probe", tokens))
    kv.free(Seq("probe", tokens))
    return [kv.pools[0].lookup(h).num_hits for h in hashes if kv.pools[0].lookup(h) is not None]


def test_a_hit_counts_once_on_every_block_it_takes_and_a_miss_not_at_all():
    kv = KVCacheManager(FullAttentionSpec(BS, 1, 1, 1), 32, model_id="m")
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    assert serve(kv, "a", prompt) == 0
    assert hits_of(kv, prompt) == [0, 0, 0]  # cached, never hit
    assert kv.top_prefixes(5) == []
    b = Seq("b", prompt)
    assert admit(kv, b) == 3 * BS
    assert hits_of(kv, prompt) == [1, 1, 1]
    top = kv.top_prefixes(5)
    assert [(r["hits"], r["tokens"], r["group"], r["state"]) for r in top] == [(1, 3 * BS, 0, "used")]
    assert top[0]["hash"] == kv.block_hashes(b)[2].hex()  # the chain's last block names it
    kv.free(b)
    assert kv.top_prefixes(5)[0]["state"] == "cached"
    assert serve(kv, "c", range(500, 513)) == 0  # a miss
    assert hits_of(kv, prompt) == [1, 1, 1]
    assert serve(kv, "d", prompt[:9]) == 2 * BS  # a shorter hit takes only the first two blocks
    assert hits_of(kv, prompt) == [2, 2, 1]


def test_top_prefixes_rank_by_hits_and_list_a_shared_prefix_once():
    """A chain's blocks hit together are one prefix (its deepest block); a prefix shared by
    several longer ones, hit more often, is listed on its own."""
    kv = KVCacheManager(FullAttentionSpec(BS, 1, 1, 1), 64, model_id="m")
    system = list(range(1, 9))  # 2 blocks every prompt shares
    x, y = list(range(20, 28)), list(range(40, 48))  # 2 blocks each
    serve(kv, "a", system + x + [0])  # caches system + x
    serve(kv, "b", system + x + [0])  # hits 4 blocks
    serve(kv, "c", system + y + [0])  # hits the system prompt's 2, caches y
    serve(kv, "d", system + x + [0])  # hits 4 blocks again
    serve(kv, "e", system + [7, 7, 7, 7, 0])  # hits the system prompt only
    assert hits_of(kv, system + x) == [4, 4, 2, 2] and hits_of(kv, system + y) == [4, 4, 0, 0]
    top = kv.top_prefixes(10)
    assert [(r["hits"], r["tokens"]) for r in top] == [(4, 2 * BS), (2, 4 * BS)]
    assert [(r["hits"], r["tokens"]) for r in kv.top_prefixes(1)] == [(4, 2 * BS)]
    assert kv.top_prefixes(0) == []
    assert len({r["hash"] for r in top}) == 2


def test_eviction_and_reuse_reset_the_counter():
    kv = KVCacheManager(FullAttentionSpec(BS, 1, 1, 1), 6, model_id="m")  # 5 usable blocks
    prompt = list(range(100, 109))  # 2 full blocks + 1
    serve(kv, "a", prompt)
    assert serve(kv, "b", prompt) == 2 * BS
    hit_blocks = [kv.pools[0].lookup(h) for h in kv.block_hashes(Seq("p", prompt))]
    assert [b.num_hits for b in hit_blocks] == [1, 1]
    other = list(range(300, 320))  # 5 blocks: evicts every cached block and reuses them all
    serve(kv, "c", other)
    assert kv.counters.evictions >= 2
    assert all(b.num_hits == 0 for b in kv.pools[0].blocks if not b.is_null)
    assert [b.block_hash is not None for b in hit_blocks] == [True, True]  # reused for c's content
    assert kv.top_prefixes(5) == []
    assert serve(kv, "d", other) == 4 * BS  # the new content's counts start from zero
    assert [(r["hits"], r["tokens"]) for r in kv.top_prefixes(5)] == [(1, 4 * BS)]
    assert serve(kv, "e", prompt) == 0  # evicted: a miss
