"""The scheduler's one handle on KV memory: hits, allocation, forks and frees."""
from __future__ import annotations

from kvos.cache.block import KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.eviction import EvictionPolicy
from kvos.cache.full_attention import FullAttentionManager
from kvos.cache.sequence import CacheableSequence
from kvos.cache.spec import FullAttentionSpec
from kvos.cache.stats import CacheCounters, CacheUsage


class KVCacheManager:
    """Coordinates the block pool and the layer-group managers.

    Contract with the scheduler:
    - ``get_computed_blocks`` before a sequence's first allocation (or after preemption); it
      never covers the last known token, whose logits must be computed.
    - ``allocate_slots`` is all-or-nothing: on False nothing changed and the caller may
      preempt and retry.
    - ``cache_blocks`` after each step that computed tokens of the sequence (never before).
    - ``free`` once per sequence that was allocated; afterwards no block is referenced by it.
    - ``take_copies`` returns the copy-on-write copies the runner must do before this step's forward.
    """

    def __init__(self, spec: FullAttentionSpec, num_blocks: int, model_id: str = "",
                 enable_caching: bool = True, policy: EvictionPolicy | None = None) -> None:
        self.counters = CacheCounters()
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching, counters=self.counters, policy=policy)
        self.group = FullAttentionManager(spec, self.pool, model_id)
        self.spec = spec

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def get_computed_blocks(self, seq: CacheableSequence) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of ``seq``: (blocks, tokens covered). The caller records the
        query with ``record_prefix_query`` once the sequence is actually admitted."""
        if not self.pool.enable_caching:
            return [], 0
        blocks = self.group.find_longest_hit(seq, seq.num_tokens - 1)
        return blocks, len(blocks) * self.block_size

    def record_prefix_query(self, num_tokens: int, hit_tokens: int) -> None:
        if self.pool.enable_caching:
            self.counters.prefix_queries_tokens += num_tokens
            self.counters.prefix_hits_tokens += hit_tokens

    def allocate_slots(self, seq: CacheableSequence, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for ``seq``'s next ``num_new_tokens`` tokens after its computed ones and
        the ``new_computed_blocks`` prefix hit (whose tokens the caller adds to
        ``num_computed_tokens`` after this returns True)."""
        new_computed = new_computed_blocks or []
        total = seq.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        if not new_computed and self.group.fits(seq, total):
            return True  # decode fast path: the last block has room and is not shared
        if self.group.num_blocks_needed(seq, total, new_computed) > self.pool.num_free_blocks():
            return False
        self.group.allocate(seq, total, new_computed)
        return True

    def cache_blocks(self, seq: CacheableSequence, num_tokens: int | None = None) -> None:
        """After a step ran: make ``seq``'s newly computed full blocks hittable (those among
        its first ``num_tokens``, default all computed ones)."""
        self.group.cache_blocks(seq, num_tokens)

    def fork(self, parent: CacheableSequence, child: CacheableSequence) -> None:
        self.group.fork(parent, child)

    def free(self, seq: CacheableSequence) -> None:
        self.group.free(seq)

    def block_ids(self, request_id: str) -> list[int]:
        return self.group.block_ids(request_id)

    def block_table(self, request_id: str) -> list[KVBlock]:
        """The live table: only valid until the sequence is next allocated, forked or freed."""
        return self.group.tables.get(request_id, [])

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.group.pending_copies = self.group.pending_copies, []
        return copies

    def usage(self) -> CacheUsage:
        return self.pool.usage()

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def stats(self) -> dict:
        return {"block_size": self.block_size, "page_bytes": self.spec.page_bytes,
                **self.usage().as_dict(), **self.counters.as_dict()}
