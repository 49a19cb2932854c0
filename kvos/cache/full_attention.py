"""Block tables of one full-attention layer group."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from kvos.cache.block import BlockHash, KVBlock, block_kind
from kvos.cache.block_pool import BlockPool
from kvos.cache.sequence import CacheableSequence
from kvos.cache.spec import KVCacheSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FullAttentionManager:
    """Per-request block tables for a group whose layers attend to every earlier token.

    Block ``i`` of a table holds tokens ``[i*block_size, (i+1)*block_size)``. Full blocks are
    registered in the group's prefix index once their KV is computed; a partially filled block
    is shared only after ``fork`` and is copied before the first write (copy-on-write).
    Subclasses may put the null block in a table where a block's KV is no longer needed.
    Chained block hashes are the coordinator's (``KVCacheManager``); every group of one pool
    uses the same block size, so they are the same for every group.
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool) -> None:
        self.spec = spec
        self.pool = pool
        self.block_size = spec.block_size
        self.tables: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []

    # -- prefix hits ---------------------------------------------------------------------
    def find_longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> list[KVBlock]:
        """Cached blocks matching ``hashes`` left to right up to the first miss, at most
        ``max_blocks``. Downward closed: every prefix of a hit is a hit. The blocks are not
        referenced until the coordinator touches them."""
        hit: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def hit_length(self, held: Callable[[int], bool], max_blocks: int) -> int:
        """The hit rule on any store: the longest ``L <= max_blocks`` such that ``held(i)`` for
        every block ``i`` a hit of ``L`` blocks needs (``needed_blocks``); here the first miss.
        Positions before 0 count as held (a store below the device is asked about the blocks
        after the device hit)."""
        n = 0
        while n < max_blocks and held(n):
            n += 1
        return n

    def needed_blocks(self, length: int) -> range:
        """The blocks a hit of ``length`` blocks needs: all of them, with full attention."""
        return range(length)

    def drop_unneeded(self, request_id: str, positions: Iterable[int]) -> None:
        """Put the null block in place of ``positions`` of the request's table and free them
        unregistered (blocks that hold no KV and that no future token reads: a sliding group's
        blocks behind the window of a prefix loaded from a tier). Never for full attention."""
        raise ValueError("a full-attention group reads every block: none can be dropped")

    # -- allocation ----------------------------------------------------------------------
    def remove_skipped_blocks(self, seq: CacheableSequence, hashes: list[BlockHash], root: BlockHash) -> None:
        """Release blocks no future token reads (none, with full attention)."""

    def num_new_blocks(self, seq: CacheableSequence, num_tokens: int, new_computed: list[KVBlock]) -> int:
        """Fresh blocks ``install`` needs for ``num_tokens`` total (a copy-on-write copy included)."""
        table = self.tables.get(seq.request_id, [])
        new = max(0, cdiv(num_tokens, self.block_size) - len(table) - len(new_computed))
        return new + (1 if self._needs_copy(seq, table) else 0)

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

    def install(self, seq: CacheableSequence, new_computed: list[KVBlock], fresh: list[KVBlock],
                num_tokens: int) -> None:
        """Append the (already referenced) hit blocks, then copy-on-write the partial block if
        shared, then append the ``fresh`` blocks (as many as ``num_new_blocks(seq, num_tokens,
        new_computed)`` said)."""
        table, fresh = self._install_hit(seq, new_computed, fresh)
        table.extend(fresh)

    def _install_hit(self, seq: CacheableSequence, new_computed: list[KVBlock],
                     fresh: list[KVBlock]) -> tuple[list[KVBlock], list[KVBlock]]:
        """``install``'s first two steps: append the hit blocks, then replace the block the next
        write goes to by a copy (one of ``fresh``) when it is shared. Returns (the table, the
        fresh blocks left)."""
        table = self.tables.setdefault(seq.request_id, [])
        table.extend(new_computed)
        fresh = list(fresh)
        if self._needs_copy(seq, table):
            i = seq.num_computed_tokens // self.block_size
            src, dst = table[i], fresh.pop()
            self.pool.free_blocks([src])
            table[i] = dst
            self.pending_copies.append((src.block_id, dst.block_id))
            self.pool.counters.cow_copies += 1
        return table, fresh

    def cache_blocks(self, seq: CacheableSequence, hashes: list[BlockHash], root: BlockHash,
                     num_tokens: int | None = None, adopted: bool = False) -> None:
        """Register ``seq``'s full blocks among its first ``num_tokens`` (default
        ``num_computed_tokens``) in the prefix index (``adopted``: their KV came from elsewhere,
        see ``BlockPoolListener.block_cached``).

        Only safe once their KV has been written (or is being written by a step already
        launched): a block registered before its step was launched could be hit while holding
        garbage if the sequence were preempted or aborted first. With async scheduling
        ``num_computed_tokens`` already counts the step in flight, so the caller passes the end
        of the step that has finished.
        """
        if not self.pool.enable_caching:
            return
        table = self.tables.get(seq.request_id, [])
        upto = seq.num_computed_tokens if num_tokens is None else min(num_tokens, seq.num_computed_tokens)
        num_full = min(upto // self.block_size, len(hashes), len(table))
        start = self._num_cached.get(seq.request_id, 0)
        prompt_len = getattr(seq, "num_prompt_tokens", None)
        for i in range(start, num_full):
            self.pool.cache_full_block(table[i], hashes[i], hashes[i - 1] if i else root, i, seq.priority,
                                       adopted=adopted, kind=block_kind(i, self.block_size, prompt_len))
        if num_full > start:
            self._num_cached[seq.request_id] = num_full

    # -- sharing and release -------------------------------------------------------------
    def fork(self, parent: CacheableSequence, child: CacheableSequence) -> None:
        """Share every block of ``parent`` with ``child`` (reference counts +1)."""
        table = list(self.tables.get(parent.request_id, []))
        self.pool.touch(table)
        self.tables[child.request_id] = table
        self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the table's blocks past ``cdiv(num_tokens, block_size)``, tail first."""
        table = self.tables.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:]
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in extra), "trim: a shared or cached block"
        self.pool.free_blocks(reversed(extra))

    def free(self, seq: CacheableSequence) -> None:
        """Release ``seq``'s blocks, tail first (so its chain's tail is evicted first)."""
        table = self.tables.pop(seq.request_id, [])
        self.pool.free_blocks(reversed(table))
        self._num_cached.pop(seq.request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, [])]

    def last_block(self, request_id: str, new_computed: list[KVBlock] = ()) -> KVBlock | None:
        """The request's last real block (its hit's, if it is being admitted with one)."""
        for block in (*reversed(new_computed), *reversed(self.tables.get(request_id, []))):
            if not block.is_null:
                return block
        return None

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request references (a full-attention table holds no null placeholder)."""
        return len(self.tables.get(request_id, ()))
