"""KV memory system: pure Python (no torch). Deals in block ids and token ids only."""
from kvos.cache.block import BlockHash, FreeBlockQueue, KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.prefix_index import PrefixIndex
from kvos.cache.spec import FullAttentionSpec
from kvos.cache.stats import CacheCounters, CacheUsage

__all__ = ["BlockHash", "BlockPool", "CacheCounters", "CacheUsage", "FreeBlockQueue",
           "FullAttentionSpec", "KVBlock", "KVCacheManager", "PrefixIndex"]
