"""The block pool: every physical block, their reference counts, and eviction order."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from kvos.cache.block import BlockHash, FreeBlockQueue, KVBlock
from kvos.cache.eviction import EvictionPolicy, LRUPolicy
from kvos.cache.prefix_index import PrefixIndex
from kvos.cache.stats import CacheCounters, CacheUsage


class BlockPool:
    """Owns ``num_blocks`` blocks; block 0 is the null block (padding for block tables).

    Unreferenced blocks with no cached content (``plain_free``) are reused first; unreferenced
    cached blocks wait in the eviction policy (LRU by default) until evicted. Callers free a
    request's blocks tail first, so under LRU a chain's tail is evicted before its parent.

    Safety rules:
    - ``get_new_blocks`` only ever hands out blocks with ``ref_cnt == 0``: a referenced block is
      never evicted or overwritten.
    - ``cache_full_block`` only after every slot of the block has been (or is being, this step)
      written; a cached block is immutable until evicted.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 index: PrefixIndex | None = None, counters: CacheCounters | None = None,
                 policy: EvictionPolicy | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1
        self.plain_free = FreeBlockQueue(self.blocks[1:])
        self.evictor = policy if policy is not None else LRUPolicy()
        self.index = index if index is not None else PrefixIndex()
        self.counters = counters if counters is not None else CacheCounters()
        self._tick = 0
        self.on_evict: Callable[[KVBlock], None] | None = None
        """Called with a block about to lose its cached content (its KV is still intact)."""
        self.newly_cached: list[KVBlock] | None = None
        """When a list, every block registered in the prefix index is appended (tier writes)."""

    # -- queries -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (plain free plus evictable cached)."""
        return len(self.plain_free) + len(self.evictor)

    def is_free(self, block: KVBlock) -> bool:
        return block.prev_free is not None or block in self.evictor

    def usage(self) -> CacheUsage:
        free, cached = len(self.plain_free), len(self.evictor)
        return CacheUsage(total=self.num_usable_blocks, free=free, cached=cached,
                          used=self.num_usable_blocks - free - cached)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.index.get(block_hash) if self.enable_caching else None

    # -- allocation ----------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks off the free queue (evicting cached content), each with ref 1."""
        if n > self.num_free_blocks():
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks()} free")
        out = []
        for _ in range(n):
            if len(self.plain_free):
                block = self.plain_free.popleft()
            else:
                block = self.evictor.pop()
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        assert block.ref_cnt == 0 and block.block_hash is not None
        if self.on_evict is not None:
            self.on_evict(block)
        self.index.remove(block.block_hash)
        block.block_hash = block.parent_hash = None
        block.num_hits = 0
        self.counters.evictions += 1

    def touch(self, blocks: Iterable[KVBlock], hit: bool = False) -> None:
        """Take a reference on each block (``hit``: a prefix-cache hit; else a fork), reviving
        unreferenced ones from the free lists."""
        self._tick += 1
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is not None:
                    self.evictor.remove(block)
                else:
                    self.plain_free.remove(block)
            if hit:
                block.num_hits += 1
                block.last_used = self._tick
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those reaching 0 are queued in the given order.

        Pass a request's blocks tail first so a chain's children are evicted before its parent.
        """
        for block in ordered:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._tick += 1
                    block.last_used = self._tick
                    self.evictor.add(block)
                    self._requeue_ancestors(block)
                else:
                    self.plain_free.appendleft(block)

    def _requeue_ancestors(self, block: KVBlock) -> None:
        """Queue ``block``'s unreferenced ancestors behind it. They are usually still referenced
        (a request frees tail first), but a chain can be built on another copy of a parent's
        content (a prompt's last token is never a hit, so it is computed again), leaving the
        registered parent queued since long before its new child."""
        parent = self.index.get(block.parent_hash) if block.parent_hash is not None else None
        while parent is not None and parent.ref_cnt == 0 and parent in self.evictor:
            self.evictor.remove(parent)
            self.evictor.add(parent)
            parent = self.index.get(parent.parent_hash) if parent.parent_hash is not None else None

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash) -> None:
        """Register a referenced, full block under its chained hash (no-op if caching is off,
        the block is already cached, or another block already holds this content)."""
        if not self.enable_caching or block.block_hash is not None or block.is_null:
            return
        if self.index.insert(block_hash, block):
            self._tick += 1
            block.block_hash = block_hash
            block.parent_hash = parent_hash
            block.cached_at = self._tick
            if self.newly_cached is not None:
                self.newly_cached.append(block)

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block's content; returns how many were dropped."""
        dropped = 0
        while len(self.evictor):
            block = self.evictor.pop()
            self._evict(block)
            self.plain_free.append(block)
            dropped += 1
        return dropped
