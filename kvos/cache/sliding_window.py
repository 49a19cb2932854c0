"""Block tables of one sliding-window layer group."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from kvos.cache.block import BlockHash, KVBlock
from kvos.cache.full_attention import FullAttentionManager, cdiv
from kvos.cache.sequence import CacheableSequence


class SlidingWindowManager(FullAttentionManager):
    """A group whose layers attend to the last ``window`` positions (the query's own included).

    Once a request has computed ``c`` tokens, its next token (position ``c``) reads keys from
    ``c - window + 1`` on, and later tokens read only later keys: a block wholly before that is
    dead. ``remove_skipped_blocks`` puts the null block in its place and releases it (registered
    first, so it stays hittable until evicted). A request therefore holds about ``window`` plus
    one prefill chunk of tokens in this group, whatever its length.

    Eviction order within the group has no chain order: a sliding block's use does not depend on
    its parent, since a hit needs only the blocks inside the window that ends at the hit length
    (``find_longest_hit``). By default never-hit blocks go first (``HitProtectedLRUPolicy``).
    """

    def __init__(self, spec, pool) -> None:
        super().__init__(spec, pool)
        self._num_skipped: dict[str, int] = {}

    @property
    def window(self) -> int:
        return self.spec.window  # type: ignore[attr-defined]

    def _first_needed_block(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) // self.block_size

    def find_longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> list[KVBlock]:
        """The longest ``L <= max_blocks`` such that the blocks the window ending at ``L``
        blocks reads, ``[L - k, L)`` with ``k = cdiv(window - 1, block_size)`` (clamped at 0),
        are all cached: null placeholders then those blocks. Not downward closed (a hit at L
        says nothing of L - 1), hence the coordinator's fixed point. Scans right to left for
        the first run of k cached blocks (or a run reaching block 0)."""
        max_blocks = min(max_blocks, len(hashes))
        if max_blocks <= 0 or not self.pool.enable_caching:
            return []
        n = self.hit_length(lambda i: self.pool.lookup(hashes[i]) is not None, max_blocks)
        needed = self.needed_blocks(n)
        return [self.pool.null_block] * needed.start + [self.pool.lookup(hashes[i]) for i in needed]  # type: ignore[misc]

    @property
    def window_blocks(self) -> int:
        """``k``: the blocks that a hit's window reads, ``cdiv(window - 1, block_size)``."""
        return cdiv(self.window - 1, self.block_size)

    def needed_blocks(self, length: int) -> range:
        """The blocks ``[length - k, length)`` (clamped at 0) that the window ending there reads."""
        return range(max(0, length - self.window_blocks), length)

    def hit_length(self, held: Callable[[int], bool], max_blocks: int) -> int:
        """The longest ``L <= max_blocks`` whose needed blocks are all ``held``: scans right to
        left for the first run of ``k`` held blocks (or a run reaching block 0, before which
        everything counts as held)."""
        k = self.window_blocks
        if max_blocks <= 0:
            return 0
        if k == 0:
            return max_blocks
        run, end = 0, 0
        for i in range(max_blocks - 1, -1, -1):
            if not held(i):
                run = 0
                continue
            if run == 0:
                end = i + 1
            run += 1
            if run >= k or i == 0:
                return end
        return 0

    def drop_unneeded(self, request_id: str, positions: Iterable[int]) -> None:
        """Null out ``positions`` (blocks behind the window, holding no KV) and free them
        unregistered, so that nothing registers their garbage under a hash. Safe only for
        positions behind the window at the request's computed length."""
        table = self.tables.get(request_id, [])
        null = self.pool.null_block
        for i in positions:
            block = table[i]
            if block.is_null:
                continue
            assert block.block_hash is None, "a dropped block must not be cached"
            table[i] = null
            self.pool.free_blocks([block])

    def remove_skipped_blocks(self, seq: CacheableSequence, hashes: list[BlockHash], root: BlockHash) -> None:
        """Release the blocks no future token of ``seq`` reads. Safe because every token of such
        a block was computed by a step already launched (the window lies behind
        ``num_computed_tokens``), so registering the block before release is safe too."""
        table = self.tables.get(seq.request_id)
        if not table:
            return
        first = min(self._first_needed_block(seq.num_computed_tokens), len(table))
        start = self._num_skipped.get(seq.request_id, 0)
        if first <= start:
            return
        null = self.pool.null_block
        for i in range(start, first):
            block = table[i]
            if block.is_null:
                continue
            if block.block_hash is None and i < len(hashes):
                self.pool.cache_full_block(block, hashes[i], hashes[i - 1] if i else root, i, seq.priority)
            table[i] = null
            self.pool.free_blocks([block])
        self._num_skipped[seq.request_id] = first

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request references (null placeholders of blocks past the window excluded)."""
        return sum(1 for b in self.tables.get(request_id, []) if not b.is_null)

    def fork(self, parent: CacheableSequence, child: CacheableSequence) -> None:
        super().fork(parent, child)
        self._num_skipped[child.request_id] = self._num_skipped.get(parent.request_id, 0)

    def free(self, seq: CacheableSequence) -> None:
        super().free(seq)
        self._num_skipped.pop(seq.request_id, None)
