"""Fixed-size slots of host memory keyed by block hash: LRU order, a free list, lazy growth."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvos.cache.block import BlockHash

Allocate = Callable[[int], memoryview]
"""``allocate(nbytes)`` returns a writable byte memoryview of exactly ``nbytes`` that stays valid
for the arena's lifetime (the engine passes pinned memory when it runs on a GPU)."""

DEFAULT_CHUNK_BYTES = 128 << 20


def allocate_bytearray(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


class SlotArena:
    """``capacity_slots`` slots of ``slot_bytes`` each, every slot starting at a multiple of
    ``align`` bytes into its chunk.

    Memory comes from ``allocate`` one chunk (about ``chunk_bytes``) at a time, only when the free
    list is empty, so a large tier does not reserve (or pin) its whole capacity at start; it is
    never returned. A key's slot is found with ``lookup`` (which makes it most recently used);
    ``evict_lru`` and ``drop`` unbind a key.

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

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._lru

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

    def alloc(self) -> int | None:
        """A free slot (growing by a chunk if none is free), or None when every slot is bound."""
        if not self._free:
            if self._num_slots == self.capacity_slots:
                return None
            n = min(self.slots_per_chunk, self.capacity_slots - self._num_slots)
            mem = self.allocate(n * self.stride)
            if len(mem) != n * self.stride:
                raise ValueError(f"allocate({n * self.stride}) returned {len(mem)} bytes")
            self.chunks.append(mem)
            self._free.extend(range(self._num_slots + n - 1, self._num_slots - 1, -1))
            self._num_slots += n
        return self._free.pop()

    def bind(self, key: BlockHash, slot: int) -> None:
        """``key`` now lives in ``slot`` (from ``alloc`` or ``evict_lru``), most recently used."""
        self._lru[key] = slot

    def evict_lru(self) -> tuple[BlockHash, int]:
        """Unbind the least recently used key; its slot (content intact) goes to the caller."""
        return self._lru.popitem(last=False)

    def drop(self, key: BlockHash) -> None:
        """Unbind ``key``; its slot goes back to the free list."""
        slot = self._lru.pop(key, None)
        if slot is not None:
            self._free.append(slot)
