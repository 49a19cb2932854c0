"""A KV block's metadata and the intrusive free queue that orders eviction.

Pure Python: no torch. A block id indexes the paged K/V tensors owned by the model runner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kvos.core.kv_events import BlockHash  # noqa: E402  (re-exported: the cache's name for it)

"""Chained content hash of a full block (16 bytes); covers the parent hash, the block's
token ids and the extra keys (model, tenant salt), so equal hashes mean equal KV content."""


PROMPT_BLOCK, PROMPT_END_BLOCK, GENERATED_BLOCK = 0, 1, 2
"""``KVBlock.kind``: prompt tokens only; the last full block of the caching request's prompt (the
prefix a conversation's next turn extends); a block holding generated tokens."""


def block_kind(index: int, block_size: int, num_prompt_tokens: int | None) -> int:
    """``KVBlock.kind`` of a sequence's ``index``-th full block (a prompt of unknown length: prompt)."""
    if num_prompt_tokens is None:
        return PROMPT_BLOCK
    end = (index + 1) * block_size
    if end > num_prompt_tokens:
        return GENERATED_BLOCK
    return PROMPT_END_BLOCK if end + block_size > num_prompt_tokens else PROMPT_BLOCK


@dataclass(eq=False, slots=True)
class KVBlock:
    """Metadata of one physical block.

    Invariants:
    - ``ref_cnt > 0`` exactly when some request's block table holds the block; such a block is
      never in the free queue and is never evicted or overwritten.
    - ``block_hash`` is set only while the block is registered in the prefix index, and only
      once all ``block_size`` slots hold KV (a full block is immutable while cached).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    is_null: bool = False
    cached_at: int = 0  # logical time the content was registered (FIFO)
    last_used: int = 0  # logical time of the last free or hit (LRU tie-breaks, LFU)
    num_hits: int = 0  # prefix hits since cached (LFU)
    depth: int = 0  # index of the block in its chain (0: the first block of a prompt)
    priority: int = 0  # the most important (lowest) priority of a request that cached or hit it
    kind: int = 0  # what the caching request had in it: PROMPT_BLOCK, PROMPT_END_BLOCK or GENERATED_BLOCK
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of unreferenced blocks, threaded through the blocks themselves.

    The head is evicted/reused first. ``popleft``, ``append``, ``appendleft`` and ``remove``
    are O(1); ``remove`` is what revives a cached block on a prefix hit without a scan.
    A block is in the queue iff its ``ref_cnt`` is 0 (the null block is never in it).
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Queue ``block`` last (evicted after everything already queued)."""
        self._link(block, self._tail.prev_free, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        """Queue ``block`` first (reused before any cached block is evicted)."""
        self._link(block, self._head, self._head.next_free)  # type: ignore[arg-type]

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def peekleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        return block

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free
