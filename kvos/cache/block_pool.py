"""The block pool: every physical block, their reference counts, and eviction order."""
from __future__ import annotations

from collections.abc import Iterable

from kvos.cache.block import BlockHash, FreeBlockQueue, KVBlock
from kvos.cache.prefix_index import PrefixIndex
from kvos.cache.stats import CacheCounters, CacheUsage


class BlockPool:
    """Owns ``num_blocks`` blocks; block 0 is the null block (padding for block tables).

    Eviction order: unreferenced blocks with no cached content are reused first; cached
    unreferenced blocks are evicted least recently freed first. Callers free a request's blocks
    tail first, so a chain's tail is always queued before its parent and evicted first.

    Safety rules:
    - ``get_new_blocks`` only ever hands out blocks with ``ref_cnt == 0``: a referenced block is
      never evicted or overwritten.
    - ``cache_full_block`` only after every slot of the block has been (or is being, this step)
      written; a cached block is immutable until evicted.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 index: PrefixIndex | None = None, counters: CacheCounters | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.index = index if index is not None else PrefixIndex()
        self.counters = counters if counters is not None else CacheCounters()
        self._num_cached_free = 0

    # -- queries -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (plain free plus evictable cached)."""
        return len(self.free_queue)

    def usage(self) -> CacheUsage:
        free_total = len(self.free_queue)
        return CacheUsage(total=self.num_usable_blocks, free=free_total - self._num_cached_free,
                          cached=self._num_cached_free, used=self.num_usable_blocks - free_total)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.index.get(block_hash) if self.enable_caching else None

    # -- allocation ----------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks off the free queue (evicting cached content), each with ref 1."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._num_cached_free -= 1
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        assert block.ref_cnt == 0 and block.block_hash is not None
        self.index.remove(block.block_hash)
        block.block_hash = block.parent_hash = None
        self.counters.evictions += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block (prefix hit or fork), reviving it from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
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
                    self.free_queue.append(block)
                    self._num_cached_free += 1
                else:
                    self.free_queue.appendleft(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash) -> None:
        """Register a referenced, full block under its chained hash (no-op if caching is off,
        the block is already cached, or another block already holds this content)."""
        if not self.enable_caching or block.block_hash is not None or block.is_null:
            return
        if self.index.insert(block_hash, block):
            block.block_hash = block_hash
            block.parent_hash = parent_hash

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block's content; returns how many were dropped."""
        dropped = 0
        for block in list(self.free_queue):
            if block.block_hash is not None:
                self.free_queue.remove(block)
                self._num_cached_free -= 1
                self._evict(block)
                self.free_queue.appendleft(block)
                dropped += 1
        return dropped
