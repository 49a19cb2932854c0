"""Eviction policies: which unreferenced cached block gives up its content first.

A policy holds exactly the blocks with ``ref_cnt == 0`` and cached content (plain free blocks
are the pool's business). Safety rule: ``add`` only blocks whose reference count just reached 0;
``remove`` a block before taking a reference on it; ``pop`` hands out a block the pool will
evict at once.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

from kvos.cache.block import BlockHash, FreeBlockQueue, KVBlock


class EvictionPolicy(ABC):
    name = "base"

    def __init__(self) -> None:
        self.clock = 0  # advanced by the pool on every add/hit: a logical time for recency

    @abstractmethod
    def add(self, block: KVBlock) -> None: ...

    @abstractmethod
    def remove(self, block: KVBlock) -> None: ...

    @abstractmethod
    def pop(self) -> KVBlock: ...

    @abstractmethod
    def peek(self) -> KVBlock:
        """The block ``pop`` would return, left in place (IndexError when empty)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[KVBlock]: ...

    def __contains__(self, block: KVBlock) -> bool:
        return any(b is block for b in self)


class LRUPolicy(EvictionPolicy):
    """Least recently freed first, in O(1) via the intrusive queue. Callers free a chain tail
    first, so a block is never evicted before the blocks that extend it."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._queue = FreeBlockQueue([])

    def add(self, block: KVBlock) -> None:
        self._queue.append(block)

    def remove(self, block: KVBlock) -> None:
        self._queue.remove(block)

    def pop(self) -> KVBlock:
        return self._queue.popleft()

    def peek(self) -> KVBlock:
        return self._queue.peekleft()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(self._queue)

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None


class HitProtectedLRUPolicy(EvictionPolicy):
    """LRU in two segments: blocks that never served a prefix hit are evicted (least recently
    freed first) before any block that did. For sliding-window groups, whose blocks are released
    while their request runs: the window at the end of a shared prefix (the blocks a hit needs)
    outlives the mid-prompt blocks that no hit can use. No chain order: a sliding block's use does
    not depend on its parent. A block's hit count does not change while it is queued (a hit takes
    a reference first), so its segment is fixed from ``add`` to removal."""

    name = "lru-protect-hits"

    def __init__(self) -> None:
        super().__init__()
        self._probation = FreeBlockQueue([])
        self._protected = FreeBlockQueue([])

    def _queue(self, block: KVBlock) -> FreeBlockQueue:
        return self._protected if block.num_hits else self._probation

    def add(self, block: KVBlock) -> None:
        self._queue(block).append(block)

    def remove(self, block: KVBlock) -> None:
        self._queue(block).remove(block)

    def peek(self) -> KVBlock:
        return (self._probation if len(self._probation) else self._protected).peekleft()

    def pop(self) -> KVBlock:
        return (self._probation if len(self._probation) else self._protected).popleft()

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self._probation
        yield from self._protected

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None


class _HeapPolicy(EvictionPolicy):
    """A min-heap on ``key(block)`` with lazy deletion (a version per queued block)."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list = []
        self._version: dict[int, int] = {}
        self._blocks: dict[int, KVBlock] = {}
        self._ids = itertools.count()

    def key(self, block: KVBlock):
        raise NotImplementedError

    def add(self, block: KVBlock) -> None:
        v = next(self._ids)
        self._version[block.block_id] = v
        self._blocks[block.block_id] = block
        heapq.heappush(self._heap, (self.key(block), v, block.block_id))

    def update(self, block: KVBlock) -> None:
        """Re-key a queued block whose key changed (no-op if it is not queued)."""
        if block.block_id in self._version:
            self.add(block)

    def remove(self, block: KVBlock) -> None:
        self._version.pop(block.block_id)
        del self._blocks[block.block_id]

    def pop(self) -> KVBlock:
        block = self.peek()
        heapq.heappop(self._heap)
        del self._version[block.block_id]
        return self._blocks.pop(block.block_id)

    def peek(self) -> KVBlock:
        while self._heap:
            _, v, bid = self._heap[0]
            if self._version.get(bid) == v:
                return self._blocks[bid]
            heapq.heappop(self._heap)  # a stale entry (removed or re-keyed)
        raise IndexError("no evictable blocks")

    def __len__(self) -> int:
        return len(self._version)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(list(self._blocks.values()))

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._version


class FIFOPolicy(_HeapPolicy):
    """Oldest content first (by when the block was cached), whatever its later use."""

    name = "fifo"

    def key(self, block: KVBlock):
        return block.cached_at


class LFUPolicy(_HeapPolicy):
    """Fewest prefix hits first; ties broken least recently used first."""

    name = "lfu"

    def key(self, block: KVBlock):
        return (block.num_hits, block.last_used)


class BeladyPolicy(_HeapPolicy):
    """Offline optimum (upper bound): evict the block whose next use is farthest in the future.

    ``next_use(hash)`` comes from an oracle that knows the whole trace (the simulator); whoever
    advances the oracle must call ``update`` for queued blocks whose next use changed.
    """

    name = "belady"

    def __init__(self, next_use: Callable[[BlockHash], float]) -> None:
        super().__init__()
        self.next_use = next_use

    def key(self, block: KVBlock):
        assert block.block_hash is not None
        return (-self.next_use(block.block_hash), -block.last_used)


POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy}


def make_policy(name: str, next_use: Callable[[BlockHash], float] | None = None) -> EvictionPolicy:
    if name == "belady":
        if next_use is None:
            raise ValueError("eviction_policy 'belady' needs a next-use oracle (simulator only)")
        return BeladyPolicy(next_use)
    if name not in POLICIES:
        raise ValueError(f"eviction_policy must be one of {sorted([*POLICIES, 'belady'])}, got {name!r}")
    return POLICIES[name]()
