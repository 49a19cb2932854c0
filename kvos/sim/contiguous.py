"""Era 1 allocation for comparison: each request reserves its maximum length up front."""
from __future__ import annotations

from kvos.cache.block import KVBlock
from kvos.cache.full_attention import cdiv
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.sequence import CacheableSequence
from kvos.cache.spec import FullAttentionSpec


class ContiguousKVManager(KVCacheManager):
    """Same interface as the paged manager, but a request's first allocation reserves
    ``reserve_tokens`` slots at once and nothing is shared or cached."""

    def __init__(self, spec: FullAttentionSpec, num_blocks: int, reserve_tokens: int) -> None:
        super().__init__(spec, num_blocks, model_id="contiguous", enable_caching=False)
        self.reserve_tokens = reserve_tokens

    def get_computed_blocks(self, seq: CacheableSequence) -> tuple[list[KVBlock], int]:
        return [], 0

    def allocate_slots(self, seq: CacheableSequence, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> bool:
        table = self.group.tables.get(seq.request_id)
        if table is None:
            need = cdiv(self.reserve_tokens, self.block_size)
            if need > self.pool.num_free_blocks():
                return False
            self.group.tables[seq.request_id] = self.pool.get_new_blocks(need)
            return True
        return seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size
