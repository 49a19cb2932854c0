"""Fixed-size slots of host memory keyed by block hash: LRU order with demand protection, a
free list, lazy growth."""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from kvos.cache.block import BlockHash

Allocate = Callable[[int], memoryview]
"""``allocate(nbytes)`` returns a writable byte memoryview of exactly ``nbytes`` that stays valid
for the arena's lifetime (the engine passes page-locked memory when it runs on a GPU)."""

DEFAULT_CHUNK_BYTES = 128 << 20

Demand = dict[BlockHash, tuple[int, int]]
"""Per block hash a waiting request will hit: (its first waiting user's queue position, the
block's position in that request's chain)."""


def allocate_bytearray(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


class SlotArena:
    """``capacity_slots`` slots of ``slot_bytes`` each, every slot starting at a multiple of
    ``align`` bytes into its chunk.

    Memory comes from ``allocate`` one chunk (about ``chunk_bytes``) at a time, only when the free
    list is empty (or ``grow`` is called), so a large tier does not reserve (or pin) its whole
    capacity at start unless its owner asks; it is never returned. A key's slot is found with ``lookup`` (which makes it most recently used);
    ``evict`` and ``drop`` unbind a key.

    Demand (``set_demand``, the waiting queue's next hits): ``evict`` takes the least recently
    used key that no waiting request will hit; only when every key is wanted does it take the
    one wanted farthest back in the queue (deepest in its chain first), as the device pool's
    ``BlockPool.hold`` does. Wanted keys met on the way are set aside, and go back to their
    places in LRU order when the demand changes.

    Safety rule: a view of a slot aliases the arena's memory. It stays valid until that slot is
    handed out again by ``alloc`` or taken by ``evict_lru`` and rewritten; the owner decides when
    that can happen (``CPUTier``: only on a put). Not thread-safe: the owner's lock guards it.
    """

    def __init__(self, slot_bytes: int, capacity_bytes: int, allocate: Allocate = allocate_bytearray,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, align: int = 64) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.stride = -(-slot_bytes // align) * align
        self.capacity_slots = capacity_bytes // self.stride
        if self.capacity_slots == 0:
            raise ValueError(f"capacity {capacity_bytes} bytes holds no slot of {slot_bytes} bytes")
        self.slots_per_chunk = max(1, min(chunk_bytes // self.stride, self.capacity_slots))
        self.allocate = allocate
        self.chunks: list[memoryview] = []
        self._num_slots = 0  # slots in allocated chunks
        self._free: list[int] = []
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self.demand: Demand = {}
        self._held: dict[BlockHash, tuple[int, int]] = {}  # wanted key -> (slot, its latest seq), under _held_for
        self._held_seq: list[BlockHash] = []  # in the order they left the front (a key may recur)
        self._held_heap: list[tuple[int, int, int, BlockHash]] = []  # (-rank, -depth, seq, key)
        self._held_for: Demand | None = None
        self.grow_on_demand = True
        """False while the owner grows the arena itself (``add_chunk``, e.g. from a background
        thread): ``alloc`` then only takes free slots."""

    def __len__(self) -> int:
        return len(self._lru) + len(self._held)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._lru or key in self._held

    def set_demand(self, demand: Demand) -> None:
        """The waiting queue's wanted keys from now on (replaces the previous demand; the
        mapping must not be mutated afterwards)."""
        self.demand = demand

    @property
    def reserved_bytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def view(self, slot: int) -> memoryview:
        chunk, i = divmod(slot, self.slots_per_chunk)  # only the last chunk may be shorter
        return self.chunks[chunk][i * self.stride: i * self.stride + self.slot_bytes]

    def lookup(self, key: BlockHash) -> int | None:
        """The slot holding ``key`` (now the most recently used), or None."""
        slot = self._lru.get(key)
        if slot is not None:
            self._lru.move_to_end(key)
            return slot
        held = self._held.pop(key, None)
        if held is None:
            return None
        self._lru[key] = held[0]  # used now: back in LRU order, most recent (its heap entry is stale)
        return held[0]

    def alloc(self) -> int | None:
        """A free slot (growing by a chunk if none is free and ``grow_on_demand``), or None."""
        if not self._free and not (self.grow_on_demand and self.grow()):
            return None
        return self._free.pop()

    def has_free(self) -> bool:
        """A slot is free now, or ``alloc`` would grow the arena for one."""
        return bool(self._free) or (self.grow_on_demand and self._num_slots < self.capacity_slots)

    def next_chunk_bytes(self) -> int:
        """Bytes of the next chunk ``grow`` would allocate; 0 once the capacity is reached."""
        return min(self.slots_per_chunk, self.capacity_slots - self._num_slots) * self.stride

    def grow(self) -> bool:
        """Allocate one more chunk of slots; False when the capacity is reached. (``alloc``
        grows on demand; an owner that wants every slot up front calls this until False, or
        allocates ``next_chunk_bytes`` itself and hands them to ``add_chunk``.)"""
        nbytes = self.next_chunk_bytes()
        if not nbytes:
            return False
        self.add_chunk(self.allocate(nbytes))
        return True

    def add_chunk(self, mem: memoryview) -> None:
        """Add a chunk of exactly ``next_chunk_bytes`` bytes (from ``allocate``) as free slots."""
        n = len(mem) // self.stride
        if not len(mem) or len(mem) != self.next_chunk_bytes():
            raise ValueError(f"a chunk of {len(mem)} bytes; the next one is {self.next_chunk_bytes()}")
        self.chunks.append(mem)
        self._free[:0] = range(self._num_slots + n - 1, self._num_slots - 1, -1)  # popped after older free slots
        self._num_slots += n

    def bind(self, key: BlockHash, slot: int) -> None:
        """``key`` now lives in ``slot`` (from ``alloc`` or ``evict``), most recently used."""
        self._lru[key] = slot

    def evict(self, wanted: bool = True) -> tuple[BlockHash, int] | None:
        """Unbind the least recently used key no waiting request wants (else, if ``wanted``, the
        one wanted farthest back; else None); its slot (content intact) goes to the caller.
        KeyError if none is bound."""
        if self._held_for is not self.demand:
            self._release_held()
        demand = self.demand
        while self._lru:
            key, slot = self._lru.popitem(last=False)
            want = demand.get(key)
            if want is None:
                return key, slot
            self._held_seq.append(key)
            self._held[key] = (slot, len(self._held_seq))
            heapq.heappush(self._held_heap, (-want[0], -want[1], len(self._held_seq), key))
            self._held_for = demand
        if not wanted and self._held:
            return None
        while self._held_heap:
            _, _, seq, key = heapq.heappop(self._held_heap)
            held = self._held.get(key)
            if held is not None and held[1] == seq:  # else dropped, or used and set aside again since
                del self._held[key]
                return key, held[0]
        raise KeyError("no key is bound")

    def _release_held(self) -> None:
        """Put the set-aside keys back at the LRU front, in their old order."""
        for key in reversed(self._held_seq):
            held = self._held.pop(key, None)
            if held is not None:
                self._lru[key] = held[0]
                self._lru.move_to_end(key, last=False)
        self._held.clear()
        self._held_seq.clear()
        self._held_heap.clear()
        self._held_for = None

    def free(self, slot: int) -> None:
        """Return an unbound slot (from ``alloc`` or ``evict``) to the free list."""
        self._free.append(slot)

    def drop(self, key: BlockHash) -> None:
        """Unbind ``key``; its slot goes back to the free list."""
        slot = self._lru.pop(key, None)
        if slot is None:
            held = self._held.pop(key, None)
            slot = None if held is None else held[0]
        if slot is not None:
            self._free.append(slot)
