"""``reuse``: evict the block with the lowest predicted hit density, learned as the engine runs.

Each evictable block belongs to a reuse class (``reuse_class``: what it holds and how often prefix
hits took it) and sits in that class's queue, least recently used first. Within a class an older
block is worth no more than a younger one, so the victim is one of the class heads: the head
whose ``HitDensityEstimator`` density at its age is lowest (ties: the least recently used).
Eviction is O(classes + log n); add, remove and restore are O(log n).

What the estimator learns from: every stay of a block's content unreferenced ends in a hit
(``on_hit``, with the block in the policy, parked behind a free child or held for a waiting
request: its class and age then) or in its eviction (``pop``). Ages are in the pool's logical
clock; the policy's "now" is the latest time it was told (a free's ``last_used`` or a hit's).

With a workload where nothing predicts reuse, every class's density falls with age alike and
the policy is LRU; it gains where classes differ (blocks of generated tokens that no later
prompt repeats, prompts hit again and again, the last block of a prompt that the next turn of
a conversation extends).
"""
from __future__ import annotations

from collections.abc import Iterator

from kvos.cache.block import KVBlock
from kvos.cache.eviction import EvictionPolicy, KeyedQueue, register_eviction_policy
from kvos.cache.reuse_estimator import HitDensityEstimator

MAX_HITS_CLASS = 3
"""Hit counts at or above this share a class."""

NUM_CLASSES = 3 * (MAX_HITS_CLASS + 1)


def reuse_class(block: KVBlock) -> int:
    """``kind`` (prompt, last full block of a prompt, generated) x prefix hits (0..3+)."""
    return block.kind * (MAX_HITS_CLASS + 1) + min(block.num_hits, MAX_HITS_CLASS)


@register_eviction_policy
class ReusePolicy(EvictionPolicy):
    name = "reuse"

    @classmethod
    def create(cls, next_use, capacity: int, block_size: int) -> EvictionPolicy:
        return cls(capacity)

    def __init__(self, capacity: int = 1024) -> None:
        self.estimator = HitDensityEstimator(NUM_CLASSES, refresh=max(64, capacity))
        self._queues = [KeyedQueue() for _ in range(NUM_CLASSES)]
        self._entry: dict[int, int] = {}  # block id -> class while queued
        self.now = 0

    def add(self, block: KVBlock) -> None:
        self.now = max(self.now, block.last_used)
        c = reuse_class(block)
        self._entry[block.block_id] = c
        self._queues[c].push(block, block.last_used)

    def on_hit(self, block: KVBlock, now: int) -> None:
        self.now = max(self.now, now)
        self.estimator.record_hit(reuse_class(block), max(0, now - block.last_used))

    def remove(self, block: KVBlock) -> None:
        self._queues[self._entry.pop(block.block_id)].remove(block)

    def _victim(self) -> tuple[int, KVBlock]:
        best: tuple[float, int] | None = None
        pick: tuple[int, KVBlock] | None = None
        for c, queue in enumerate(self._queues):
            if len(queue):
                head = queue.peek()
                score = (self.estimator.density(c, self.now - head.last_used), head.last_used)
                if best is None or score < best:
                    best, pick = score, (c, head)
        if pick is None:
            raise IndexError("no evictable blocks")
        return pick

    def peek(self) -> KVBlock:
        return self._victim()[1]

    def pop(self) -> KVBlock:
        c, block = self._victim()
        self._queues[c].pop()
        del self._entry[block.block_id]
        self.estimator.record_eviction(c, max(0, self.now - block.last_used))
        return block

    def __len__(self) -> int:
        return len(self._entry)

    def __iter__(self) -> Iterator[KVBlock]:
        for queue in self._queues:
            yield from queue

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._entry
