"""Block tables of one full-attention layer group."""
from __future__ import annotations

from kvos.cache.block import BlockHash, KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.cache.sequence import CacheableSequence
from kvos.cache.spec import FullAttentionSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FullAttentionManager:
    """Per-request block tables for a group whose layers attend to every earlier token.

    Block ``i`` of a table holds tokens ``[i*block_size, (i+1)*block_size)``. Full blocks are
    registered in the prefix index once their KV is computed; a partially filled block
    is shared only after ``fork`` and is copied before the first write (copy-on-write).
    """

    def __init__(self, spec: FullAttentionSpec, pool: BlockPool, model_id: str) -> None:
        self.spec = spec
        self.pool = pool
        self.model_id = model_id
        self.tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def block_hashes(self, seq: CacheableSequence) -> list[BlockHash]:
        """Chained hashes of every full block of ``seq``'s known tokens (computed lazily)."""
        hashes = self._hashes.setdefault(seq.request_id, [])
        extend_block_hashes(hashes, seq.all_token_ids, self.block_size,
                            root_hash(self.model_id, seq.cache_salt))
        return hashes

    def find_longest_hit(self, seq: CacheableSequence, max_tokens: int) -> list[KVBlock]:
        """Cached blocks matching ``seq`` left to right up to the first miss, covering at most
        ``max_tokens`` tokens. The blocks are not referenced until ``allocate`` touches them."""
        hit: list[KVBlock] = []
        for block_hash in self.block_hashes(seq)[: max_tokens // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def num_blocks_needed(self, seq: CacheableSequence, num_tokens: int,
                          new_computed: list[KVBlock]) -> int:
        """Free blocks that ``allocate`` would take off the free queue for ``num_tokens`` total."""
        table = self.tables.get(seq.request_id, [])
        new = max(0, cdiv(num_tokens, self.block_size) - len(table) - len(new_computed))
        revived = sum(1 for b in new_computed if b.ref_cnt == 0)
        return new + revived + (1 if self._needs_copy(seq, table) else 0)

    def fits(self, seq: CacheableSequence, num_tokens: int) -> bool:
        """True when ``seq``'s table already holds ``num_tokens`` and no write needs a copy."""
        table = self.tables.get(seq.request_id)
        if table is None or cdiv(num_tokens, self.block_size) > len(table):
            return False
        return not self._needs_copy(seq, table)

    def _needs_copy(self, seq: CacheableSequence, table: list[KVBlock]) -> bool:
        pos = seq.num_computed_tokens
        if pos % self.block_size == 0 or pos // self.block_size >= len(table):
            return False
        return table[pos // self.block_size].ref_cnt > 1

    def allocate(self, seq: CacheableSequence, num_tokens: int, new_computed: list[KVBlock]) -> None:
        """Grow ``seq``'s table to hold ``num_tokens`` tokens. Caller checked
        ``num_blocks_needed`` against the pool's free blocks."""
        table = self.tables.setdefault(seq.request_id, [])
        if new_computed:
            self.pool.touch(new_computed, hit=True)
            table.extend(new_computed)
        if self._needs_copy(seq, table):
            i = seq.num_computed_tokens // self.block_size
            src = table[i]
            (dst,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([src])
            table[i] = dst
            self.pending_copies.append((src.block_id, dst.block_id))
            self.pool.counters.cow_copies += 1
        need = cdiv(num_tokens, self.block_size) - len(table)
        if need > 0:
            table.extend(self.pool.get_new_blocks(need))

    def cache_blocks(self, seq: CacheableSequence, num_tokens: int | None = None) -> None:
        """Register ``seq``'s full blocks among its first ``num_tokens`` (default
        ``num_computed_tokens``) in the prefix index.

        Only safe once their KV has been written: a block registered before its step ran could
        be hit while holding garbage if the sequence were preempted or aborted first. With
        async scheduling ``num_computed_tokens`` already counts the step in flight, so the
        caller passes the end of the step that has finished.
        """
        table = self.tables.get(seq.request_id, [])
        upto = seq.num_computed_tokens if num_tokens is None else min(num_tokens, seq.num_computed_tokens)
        num_full = upto // self.block_size
        start = self._num_cached.get(seq.request_id, 0)
        if num_full <= start or not self.pool.enable_caching:
            return
        hashes = self.block_hashes(seq)
        root = root_hash(self.model_id, seq.cache_salt)
        for i in range(start, num_full):
            self.pool.cache_full_block(table[i], hashes[i], hashes[i - 1] if i else root)
        self._num_cached[seq.request_id] = num_full

    def fork(self, parent: CacheableSequence, child: CacheableSequence) -> None:
        """Share every block of ``parent`` with ``child`` (reference counts +1)."""
        table = list(self.tables.get(parent.request_id, []))
        self.pool.touch(table)
        self.tables[child.request_id] = table
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)

    def free(self, seq: CacheableSequence) -> None:
        """Release ``seq``'s blocks, tail first (so its chain's tail is evicted first)."""
        table = self.tables.pop(seq.request_id, [])
        self.pool.free_blocks(reversed(table))
        self._hashes.pop(seq.request_id, None)
        self._num_cached.pop(seq.request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, [])]
