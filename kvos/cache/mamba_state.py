"""State tables of one Mamba layer group: a recurrent state per request, kept at block boundaries."""
from __future__ import annotations

from kvos.cache.block import KVBlock
from kvos.cache.full_attention import cdiv
from kvos.cache.sequence import CacheableSequence
from kvos.cache.sliding_window import SlidingWindowManager


class MambaStateManager(SlidingWindowManager):
    """Per-request tables of state pages (``MambaStateSpec``), indexed like KV blocks.

    Position ``i`` of a table, when it is not the null block, holds the state after tokens
    ``[0, min(c, (i + 1) * block_size))`` of a request that has computed ``c`` tokens. Rules:

    - The *current* block, ``(c - 1) // block_size``, holds the state after the last computed
      token and is the only one a step reads; a step writes its final state into the block of
      its last token (in place when that is the current block: copy-on-write first when shared,
      after ``fork``), and the state at each block boundary it crosses into the boundary's block
      when that position has a page.
    - Positions that get a page when allocated: the last of the step, every block ending a
      multiple of ``cache_every`` blocks (a prefill's checkpoints, with prefix caching on), and for a sequence being
      swapped back in the block of its last swapped token (where its saved state goes); the rest
      are null.
    - A block behind the current one holds the state at its own boundary, exactly (the step that
      crossed it wrote it): it is registered under the chain hash of its blocks and released, as a
      sliding window of one token would (``SlidingWindowManager`` with ``window`` 2). Registration
      is full attention's ``cache_blocks``: the pool skips null positions.
    - A prefix hit of ``L`` blocks needs only block ``L - 1`` (the state after the prefix): the
      table starts ``L - 1`` null blocks, then that block, which the request only reads (its next
      token starts block ``L``).
    Never write a registered block: the rules above guarantee it, since only the current block is
    written in place and it is registered only once it lies behind a boundary the request passed.
    """

    @property
    def window(self) -> int:
        return 2  # the next token reads the state after the last computed one

    @property
    def cache_every(self) -> int:
        return self.spec.cache_every  # type: ignore[attr-defined]

    def _has_page(self, position: int, last: int, restore: int = -1) -> bool:
        checkpoint = self.pool.enable_caching and (position + 1) % self.cache_every == 0
        return position == last or position == restore or checkpoint

    def _restore_block(self, seq: CacheableSequence) -> int:
        swapped = getattr(seq, "swapped_tokens", 0)
        return (swapped - 1) // self.block_size if swapped else -1

    def num_new_blocks(self, seq: CacheableSequence, num_tokens: int, new_computed: list[KVBlock]) -> int:
        table = self.tables.get(seq.request_id, [])
        first, last = len(table) + len(new_computed), cdiv(num_tokens, self.block_size) - 1
        restore = self._restore_block(seq)
        new = sum(1 for i in range(first, last + 1) if self._has_page(i, last, restore))
        return new + (1 if self._needs_copy(seq, table) else 0)

    def install(self, seq: CacheableSequence, new_computed: list[KVBlock], fresh: list[KVBlock],
                num_tokens: int) -> None:
        table, fresh = self._install_hit(seq, new_computed, fresh)
        last, restore = cdiv(num_tokens, self.block_size) - 1, self._restore_block(seq)
        fresh.reverse()
        for i in range(len(table), last + 1):
            table.append(fresh.pop() if self._has_page(i, last, restore) else self.pool.null_block)
        assert not fresh, "install: fresh blocks left over"

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """State pages one request of ``num_tokens`` holds at most, prefilled in chunks of
        ``chunk``: the current block, one chunk's checkpoints and its last block."""
        blocks = cdiv(num_tokens, self.block_size)
        return min(blocks, 2 + cdiv(chunk, self.block_size * self.cache_every))

    def trim(self, request_id: str, num_tokens: int) -> None:
        raise ValueError("a Mamba state cannot be rolled back to fewer tokens (speculative decoding is "
                         "not supported with Mamba layers)")
