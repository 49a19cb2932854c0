"""Block tables of one sliding-window layer group."""
from __future__ import annotations

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
        null = self.pool.null_block
        k = cdiv(self.window - 1, self.block_size)
        max_blocks = min(max_blocks, len(hashes))
        if max_blocks <= 0 or not self.pool.enable_caching:
            return []
        if k == 0:
            return [null] * max_blocks
        run, end = 0, 0
        for i in range(max_blocks - 1, -1, -1):
            if self.pool.lookup(hashes[i]) is None:
                run = 0
                continue
            if run == 0:
                end = i + 1
            run += 1
            if run >= k or i == 0:
                return [null] * (end - run) + [self.pool.lookup(h) for h in hashes[end - run: end]]  # type: ignore[misc]
        return []

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
