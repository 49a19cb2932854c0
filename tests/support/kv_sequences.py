"""A minimal sequence for driving ``KVCacheManager`` directly in tests, and one step that
computes its whole prompt."""
from __future__ import annotations

from kvos.cache import KVCacheManager


class Seq:
    def __init__(self, rid, tokens, salt=None):
        self.request_id, self.all_token_ids, self.cache_salt = rid, list(tokens), salt
        self.num_computed_tokens = 0
        self.priority = 0

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


def run(kv: KVCacheManager, seq: Seq) -> int:
    """Prefix lookup, allocation and one step computing the whole prompt; returns the hit tokens."""
    hit, n = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - n, hit)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_blocks(seq)
    return n
