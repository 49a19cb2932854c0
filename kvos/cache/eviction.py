"""Eviction policies: which unreferenced cached block gives up its content first.

A policy holds the evictable blocks the pool offers it: cached, ``ref_cnt == 0`` and (full
attention) no unreferenced cached block extending them, so whatever a policy picks, a chain
loses its tail before its head (see ``BlockPool``). A parent offered after its last child went
is keyed by its own history, as if it had been there all along. Safety rule: ``add`` only
blocks the pool offers; ``remove`` a block before taking a reference on it; ``pop`` hands out a
block the pool will evict at once.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from kvos.cache.block import BlockHash, FreeBlockQueue, KVBlock
from kvos.core.registry import Registry


class EvictionPolicy(ABC):
    name = "base"
    offline = False
    """True for a policy that reads the future (it needs a next-use oracle: the simulator's)."""

    @classmethod
    def create(cls, next_use: Callable[[BlockHash], float] | None, capacity: int, block_size: int) -> EvictionPolicy:
        """A policy for a pool of ``capacity`` blocks of ``block_size`` tokens; ``next_use`` is the
        simulator's oracle (None in an engine). Override when the constructor takes any of them."""
        return cls()

    @abstractmethod
    def add(self, block: KVBlock) -> None: ...

    @abstractmethod
    def remove(self, block: KVBlock) -> None: ...

    def restore(self, block: KVBlock) -> None:
        """Put back a block taken out with ``remove`` and not used meanwhile (held for a
        waiting request): as if it had never left."""
        self.add(block)

    def expect(self, hashes: Iterable[BlockHash]) -> None:
        """``hashes`` are about to be cached in this pool, and the room for them is being made
        now (a batch's slots are all taken before any is bound). A policy that remembers
        evicted hashes sets these aside, so the evictions for their own room cannot push them
        out: each is then found as it would be were the batch stored one block at a time. Only
        hints: a hash set aside and never cached is forgotten as the ghosts are. No-op here."""

    def on_hit(self, block: KVBlock, now: int) -> None:
        """A prefix hit at logical time ``now`` takes ``block``, cached and unreferenced (in this
        policy, parked behind a free child, or held for a waiting request), before its
        ``last_used`` and ``num_hits`` change. For policies that learn from hits; no-op here."""

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


EVICTION_POLICIES: Registry[type[EvictionPolicy]] = Registry("eviction policy")
"""Eviction policies by name, filled by ``register_eviction_policy``: the engine's and the
simulator's choices (the engine's are the online ones, ``online_policies``)."""
register_eviction_policy = EVICTION_POLICIES.register


def online_policies() -> tuple[str, ...]:
    """Names of the registered policies that need no oracle (an engine's choices)."""
    return tuple(name for name, cls in EVICTION_POLICIES.items() if not cls.offline)


class KeyedQueue:
    """Blocks ordered by a key fixed at ``push`` (smallest first): a min-heap with lazy deletion,
    O(log n) push and pop, O(1) remove."""

    def __init__(self) -> None:
        self._heap: list = []
        self._version: dict[int, int] = {}
        self._blocks: dict[int, KVBlock] = {}
        self._ids = itertools.count()

    def push(self, block: KVBlock, key) -> None:
        v = next(self._ids)
        self._version[block.block_id] = v
        self._blocks[block.block_id] = block
        heapq.heappush(self._heap, (key, v, block.block_id))

    def remove(self, block: KVBlock) -> None:
        del self._version[block.block_id]
        del self._blocks[block.block_id]

    def peek_entry(self) -> tuple:
        """(key, version, block id) of the smallest live entry."""
        while self._heap:
            entry = self._heap[0]
            if self._version.get(entry[2]) == entry[1]:
                return entry
            heapq.heappop(self._heap)  # a stale entry (removed or re-keyed)
        raise IndexError("no evictable blocks")

    def peek(self) -> KVBlock:
        return self._blocks[self.peek_entry()[2]]

    def pop(self) -> KVBlock:
        block = self.peek()
        heapq.heappop(self._heap)
        del self._version[block.block_id]
        return self._blocks.pop(block.block_id)

    def __len__(self) -> int:
        return len(self._version)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(list(self._blocks.values()))

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._version


class _HeapPolicy(EvictionPolicy):
    """One ``KeyedQueue`` on ``key(block)``."""

    def __init__(self) -> None:
        self._queue = KeyedQueue()

    def key(self, block: KVBlock):
        raise NotImplementedError

    def add(self, block: KVBlock) -> None:
        self._queue.push(block, self.key(block))

    def update(self, block: KVBlock) -> None:
        """Re-key a queued block whose key changed (no-op if it is not queued)."""
        if block in self._queue:
            self._queue.push(block, self.key(block))

    def remove(self, block: KVBlock) -> None:
        self._queue.remove(block)

    def pop(self) -> KVBlock:
        return self._queue.pop()

    def peek(self) -> KVBlock:
        return self._queue.peek()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(self._queue)

    def __contains__(self, block: KVBlock) -> bool:
        return block in self._queue


@register_eviction_policy
class LRUPolicy(_HeapPolicy):
    """Least recently used first: by the logical time of the block's last free (a block is
    freed after every use, a chain's parent after its children)."""

    name = "lru"

    def key(self, block: KVBlock):
        return block.last_used


class HitProtectedLRUPolicy(EvictionPolicy):
    """LRU in two segments: blocks that never served a prefix hit are evicted (least recently
    freed first) before any block that did. For sliding-window groups, whose blocks are released
    while their request runs: the window at the end of a shared prefix (the blocks a hit needs)
    outlives the mid-prompt blocks that no hit can use. No chain order: a sliding block's use does
    not depend on its parent. A block's hit count does not change while it is queued (a hit takes
    a reference first), so its segment is fixed from ``add`` to removal. O(1)."""

    name = "lru-protect-hits"

    def __init__(self) -> None:
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


@register_eviction_policy
class FIFOPolicy(_HeapPolicy):
    """Oldest content first (by when the block was cached), whatever its later use."""

    name = "fifo"

    def key(self, block: KVBlock):
        return block.cached_at


@register_eviction_policy
class LFUPolicy(_HeapPolicy):
    """Fewest prefix hits first; ties broken least recently used first."""

    name = "lfu"

    def key(self, block: KVBlock):
        return (block.num_hits, block.last_used)


class _TwoQueuePolicy(EvictionPolicy):
    """A policy whose evictable blocks sit in ``self._queues``, two ``KeyedQueue`` s."""

    _queues: tuple[KeyedQueue, KeyedQueue]

    def __len__(self) -> int:
        return len(self._queues[0]) + len(self._queues[1])

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self._queues[0]
        yield from self._queues[1]

    def __contains__(self, block: KVBlock) -> bool:
        return block in self._queues[0] or block in self._queues[1]


@register_eviction_policy
class S3FIFOPolicy(_TwoQueuePolicy):
    """S3-FIFO (Yang et al., SOSP'23) over the evictable blocks: a small FIFO for blocks freed
    for the first time since they were cached, a main FIFO for blocks used again, and a ghost
    FIFO of recently evicted hashes. A block leaving the small queue moves to main if it was
    used again, else is evicted (its hash remembered); a block whose hash is a ghost goes
    straight to main. Main is a CLOCK: a used block is re-queued with one use less. A block's
    queue and use count survive while it is referenced (a hit takes it out of the policy; it
    comes back one use richer). Queue position: the time of the block's last free (re-queued:
    the latest time seen). Amortised O(log n)."""

    name = "s3fifo"
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    @classmethod
    def create(cls, next_use, capacity: int, block_size: int) -> EvictionPolicy:
        return cls(capacity)

    def __init__(self, capacity: int = 1024) -> None:
        self._small = KeyedQueue()
        self._main = KeyedQueue()
        self._queues = (self._small, self._main)
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self._ghost_size = max(1, capacity)
        self._returning: OrderedDict[BlockHash, None] = OrderedDict()  # ghosts set aside by ``expect``
        self._state: dict[int, list] = {}  # block_id -> [cached_at, freq, in_main, last_used when last offered]
        self._latest = 0

    def _st(self, block: KVBlock) -> list:
        st = self._state.get(block.block_id)
        if st is None or st[0] != block.cached_at:  # first free since this content was cached
            h = block.block_hash
            in_main = h in self._ghost or h in self._returning
            if in_main:
                self._ghost.pop(h, None)  # type: ignore[arg-type]
                self._returning.pop(h, None)  # type: ignore[arg-type]
            st = self._state[block.block_id] = [block.cached_at, -1, in_main, None]
        return st

    def expect(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            if h in self._ghost:
                del self._ghost[h]
                self._returning[h] = None
                if len(self._returning) > self._ghost_size:
                    self._returning.popitem(last=False)

    def add(self, block: KVBlock) -> None:
        """A use is a free since the block was last offered (its ``last_used`` moved): a parent
        offered again when its last child went, unused meanwhile, gains nothing."""
        st = self._st(block)
        if st[3] != block.last_used:
            st[1] = min(st[1] + 1, self.MAX_FREQ)  # -1 on the first free: its computation is no use
            st[3] = block.last_used
        self._latest = max(self._latest, block.last_used)
        (self._main if st[2] else self._small).push(block, block.last_used)

    def remove(self, block: KVBlock) -> None:
        (self._main if self._state[block.block_id][2] else self._small).remove(block)

    def restore(self, block: KVBlock) -> None:
        (self._main if self._state[block.block_id][2] else self._small).push(block, block.last_used)

    def peek(self) -> KVBlock:
        """Runs the queues' lazy moves (they change no cached content) up to the next victim."""
        while True:
            total = len(self._small) + len(self._main)
            if not total:
                raise IndexError("no evictable blocks")
            from_small = len(self._small) and (len(self._small) > self.SMALL_FRACTION * total or not len(self._main))
            queue = self._small if from_small else self._main
            block = queue.peek()
            st = self._state[block.block_id]
            if st[1] <= 0:
                return block
            queue.remove(block)
            if from_small:
                st[1], st[2] = 0, True
            else:
                st[1] -= 1
            self._latest += 1
            self._main.push(block, self._latest)

    def pop(self) -> KVBlock:
        block = self.peek()
        st = self._state.pop(block.block_id)
        (self._main if st[2] else self._small).remove(block)
        if not st[2] and block.block_hash is not None:
            self._ghost[block.block_hash] = None
            if len(self._ghost) > self._ghost_size:
                self._ghost.popitem(last=False)
        return block


@register_eviction_policy
class ARCPolicy(_TwoQueuePolicy):
    """ARC (Megiddo & Modha, FAST'03) over the evictable blocks: T1 holds blocks not hit since
    they were cached, T2 blocks hit at least once, each least recently used first; ghosts B1
    and B2 remember hashes evicted from each. Recomputing a block whose hash is in B1 grows the
    target size ``p`` of T1, one in B2 shrinks it; eviction takes from T1 while it is over
    ``p``. O(log n)."""

    name = "arc"

    @classmethod
    def create(cls, next_use, capacity: int, block_size: int) -> EvictionPolicy:
        return cls(capacity)

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self._t1 = KeyedQueue()
        self._t2 = KeyedQueue()
        self._queues = (self._t1, self._t2)
        self._b1: OrderedDict[BlockHash, None] = OrderedDict()
        self._b2: OrderedDict[BlockHash, None] = OrderedDict()
        self._seen: dict[int, int] = {}  # block_id -> cached_at of content already adapted on
        self._returning: OrderedDict[BlockHash, bool] = OrderedDict()  # set aside by ``expect``: from B1?

    def _queue(self, block: KVBlock) -> KeyedQueue:
        return self._t2 if block.num_hits else self._t1

    def _take_ghost(self, h: BlockHash | None) -> bool | None:
        """Forget ``h``'s ghost: True if it was in B1, False if in B2, None if in neither."""
        if h in self._b1:
            del self._b1[h]  # type: ignore[arg-type]
            return True
        if h in self._b2:
            del self._b2[h]  # type: ignore[arg-type]
            return False
        return None

    def expect(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            from_b1 = self._take_ghost(h)
            if from_b1 is not None:
                self._returning[h] = from_b1
                if len(self._returning) > self.capacity:
                    self._returning.popitem(last=False)

    def add(self, block: KVBlock) -> None:
        if self._seen.get(block.block_id) != block.cached_at:  # first free of this content
            self._seen[block.block_id] = block.cached_at
            h = block.block_hash
            from_b1 = self._returning.pop(h, None)  # type: ignore[arg-type]
            if from_b1 is None:
                from_b1 = self._take_ghost(h)
            if from_b1 is not None:
                b1, b2 = len(self._b1) + from_b1, len(self._b2) + (not from_b1)  # with h still in its list
                if from_b1:
                    self.p = min(float(self.capacity), self.p + max(1.0, b2 / b1))
                else:
                    self.p = max(0.0, self.p - max(1.0, b1 / b2))
        self._queue(block).push(block, block.last_used)

    def remove(self, block: KVBlock) -> None:
        self._queue(block).remove(block)

    def peek(self) -> KVBlock:
        if len(self._t1) and (len(self._t1) > self.p or not len(self._t2)):
            return self._t1.peek()
        return self._t2.peek()

    def pop(self) -> KVBlock:
        block = self.peek()
        queue = self._queue(block)
        queue.remove(block)
        self._seen.pop(block.block_id, None)
        ghosts = self._b1 if queue is self._t1 else self._b2
        if block.block_hash is not None:
            ghosts[block.block_hash] = None
            if len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return block


@register_eviction_policy
class WeightedPolicy(_HeapPolicy):
    """GreedyDual-Size-Frequency over the evictable blocks: a block's value is
    ``L + weight * uses * cost``, the lowest value is evicted and ``L`` rises to it (so old
    values age without rescans). ``uses`` is 1 + its prefix hits; ``cost`` the attention work
    to recompute it, ``1 + depth * block_size / cost_context`` (a deep block attends to more);
    ``weight`` is ``2 ** -priority`` of the most important request that cached or hit it (a
    priority -1 tenant's prefixes are worth twice a priority 0 one's). O(log n)."""

    name = "weighted"

    @classmethod
    def create(cls, next_use, capacity: int, block_size: int) -> EvictionPolicy:
        return cls(block_size)

    def __init__(self, block_size: int = 16, cost_context: int = 4096) -> None:
        super().__init__()
        self.block_size = block_size
        self.cost_context = cost_context
        self.inflation = 0.0

    def value(self, block: KVBlock) -> float:
        weight = 2.0 ** -max(-16, min(16, block.priority))
        cost = 1.0 + block.depth * self.block_size / self.cost_context
        return weight * (1 + block.num_hits) * cost

    def key(self, block: KVBlock):
        return (self.inflation + self.value(block), block.last_used)

    def pop(self) -> KVBlock:
        self.inflation = self._queue.peek_entry()[0][0]
        return self._queue.pop()


@register_eviction_policy
class BeladyPolicy(_HeapPolicy):
    """Offline optimum (upper bound): evict the block whose next use is farthest in the future,
    ties toward the deepest block (a chain's tail), so no chain keeps a tail whose head is gone.

    ``next_use(hash)`` comes from an oracle that knows the whole trace (the simulator); whoever
    advances the oracle must call ``update`` for queued blocks whose next use changed.
    """

    name = "belady"
    offline = True

    @classmethod
    def create(cls, next_use, capacity: int, block_size: int) -> EvictionPolicy:
        if next_use is None:
            raise ValueError("eviction_policy 'belady' needs a next-use oracle (simulator only)")
        return cls(next_use)

    def __init__(self, next_use: Callable[[BlockHash], float]) -> None:
        super().__init__()
        self.next_use = next_use

    def key(self, block: KVBlock):
        assert block.block_hash is not None
        return (-self.next_use(block.block_hash), -block.depth, -block.last_used)


def make_policy(name: str, next_use: Callable[[BlockHash], float] | None = None, capacity: int = 1024,
                block_size: int = 16) -> EvictionPolicy:
    """The registered policy ``name`` (``EVICTION_POLICIES``). ``capacity``: the pool's blocks
    (sizes the ghost lists of s3fifo and arc); ``next_use``: the simulator's oracle (belady)."""
    cls = EVICTION_POLICIES.get(name)
    if cls is None:
        raise ValueError(f"eviction_policy must be one of {list(EVICTION_POLICIES)}, got {name!r}")
    return cls.create(next_use, capacity, block_size)
