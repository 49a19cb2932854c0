"""KV memory system: pure Python (no torch). Deals in block ids and token ids only."""
from kvos.cache.block import BlockHash, FreeBlockQueue, KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.layout import CacheGroup, CacheLayout, build_layout
from kvos.cache.page_pool import LargePagePool
from kvos.cache.prefix_index import PrefixIndex
from kvos.cache.reuse_policy import ReusePolicy  # registers the "reuse" eviction policy
from kvos.cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvos.cache.stats import CacheCounters, CacheUsage

__all__ = ["BlockHash", "BlockPool", "CacheCounters", "CacheGroup", "CacheLayout", "CacheUsage",
           "FreeBlockQueue", "FullAttentionSpec", "KVBlock", "KVCacheManager", "KVCacheSpec",
           "LargePagePool", "PrefixIndex", "ReusePolicy", "SlidingWindowSpec", "build_layout"]
