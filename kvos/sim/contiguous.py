"""Era 1 allocation for comparison: each request reserves its maximum length up front."""
from __future__ import annotations

from kvos.cache.kv_manager import ComputedBlocks, KVCacheManager
from kvos.cache.sequence import CacheableSequence
from kvos.cache.spec import FullAttentionSpec


class ContiguousKVManager(KVCacheManager):
    """Same interface as the paged manager, but a request's first allocation reserves
    ``reserve_tokens`` slots at once and nothing is shared or cached."""

    def __init__(self, spec: FullAttentionSpec, num_blocks: int, reserve_tokens: int) -> None:
        super().__init__(spec, num_blocks, model_id="contiguous", enable_caching=False)
        self.reserve_tokens = reserve_tokens

    def allocate_slots(self, seq: CacheableSequence, num_new_tokens: int,
                       new_computed: ComputedBlocks | None = None) -> bool:
        if not self.num_held_blocks(seq.request_id):
            return super().allocate_slots(seq, max(self.reserve_tokens, num_new_tokens) - seq.num_computed_tokens)
        return seq.num_computed_tokens + num_new_tokens <= self.num_held_blocks(seq.request_id) * self.block_size
