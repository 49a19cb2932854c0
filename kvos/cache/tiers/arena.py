"""Fixed-size slots of host memory keyed by block hash: a free list, lazy growth, and the bound
keys' eviction order (``SlotKeys``: an eviction policy with demand protection)."""
from __future__ import annotations

from collections.abc import Callable

from kvos.cache.block import BlockHash
from kvos.cache.eviction import EvictionPolicy, make_policy
from kvos.cache.tiers.slot_keys import Demand, SlotKeys

Allocate = Callable[[int], memoryview]
"""``allocate(nbytes)`` returns a writable byte memoryview of exactly ``nbytes`` that stays valid
for the arena's lifetime (the engine passes page-locked memory when it runs on a GPU)."""

DEFAULT_CHUNK_BYTES = 128 << 20

__all__ = ["DEFAULT_CHUNK_BYTES", "Allocate", "Demand", "SlotArena", "allocate_bytearray"]


def allocate_bytearray(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


class SlotArena:
    """``capacity_slots`` slots of ``slot_bytes`` each, every slot starting at a multiple of
    ``align`` bytes into its chunk.

    Memory comes from ``allocate`` one chunk (about ``chunk_bytes``) at a time, only when the free
    list is empty (or ``grow`` is called), so a large tier does not reserve (or pin) its whole
    capacity at start unless its owner asks; it is never returned.

    Keys (``keys``, a ``SlotKeys``): ``bind`` puts a key in a slot, ``lookup`` finds it (a hit,
    which the eviction policy hears), ``evict`` and ``drop`` unbind one. ``policy`` (a name of
    ``kvos.cache.eviction``'s registry, sized for ``capacity_slots``, or a policy object) picks
    the victim among the keys no waiting request will hit (``set_demand``); only when every key
    is wanted does ``evict`` take the one wanted farthest back in the queue (deepest in its
    chain first), as the device pool's ``BlockPool.hold`` does. The default, ``lru``, evicts
    the least recently bound or hit key first.

    Safety rule: a view of a slot aliases the arena's memory. It stays valid until that slot is
    handed out again by ``alloc`` or taken by ``evict`` and rewritten; the owner decides when
    that can happen (``CPUTier``: only on a put). Not thread-safe: the owner's lock guards it.
    """

    def __init__(self, slot_bytes: int, capacity_bytes: int, allocate: Allocate = allocate_bytearray,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, align: int = 64,
                 policy: str | EvictionPolicy = "lru") -> None:
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
        self.keys = SlotKeys(make_policy(policy, capacity=self.capacity_slots) if isinstance(policy, str)
                             else policy)
        self.grow_on_demand = True
        """False while the owner grows the arena itself (``add_chunk``, e.g. from a background
        thread): ``alloc`` then only takes free slots."""

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.keys

    @property
    def _lru(self) -> dict[BlockHash, int]:
        """The bound keys, key -> slot (this name is older than the eviction policies: callers that
        read it get every bound key, in no particular order)."""
        return self.keys.slots

    @property
    def policy(self) -> EvictionPolicy:
        return self.keys.policy

    def set_demand(self, demand: Demand) -> None:
        """The waiting queue's wanted keys from now on (replaces the previous demand; the
        mapping must not be mutated afterwards)."""
        self.keys.set_demand(demand)

    @property
    def reserved_bytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def view(self, slot: int) -> memoryview:
        chunk, i = divmod(slot, self.slots_per_chunk)  # only the last chunk may be shorter
        return self.chunks[chunk][i * self.stride: i * self.stride + self.slot_bytes]

    def lookup(self, key: BlockHash) -> int | None:
        """The slot holding ``key`` (a hit: the policy hears it), or None."""
        return self.keys.lookup(key)

    def peek(self, key: BlockHash) -> int | None:
        """The slot holding ``key``, or None; the policy hears nothing (``SlotKeys.hit_chain``
        tells it of a load's hits afterwards)."""
        return self.keys.slots.get(key)

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

    def bind(self, key: BlockHash, slot: int, parent: BlockHash | None = None) -> None:
        """``key`` (not bound) now lives in ``slot`` (from ``alloc`` or ``evict``); ``parent``:
        the key before it in its chain (``SlotKeys``: chain order)."""
        self.keys.bind(key, slot, parent)

    def evict(self, wanted: bool = True) -> tuple[BlockHash, int] | None:
        """Unbind the policy's choice among the keys no waiting request wants (else, if
        ``wanted``, the one wanted farthest back; else None); its slot (content intact) goes to
        the caller. KeyError if none is bound."""
        return self.keys.evict(wanted)

    def free(self, slot: int) -> None:
        """Return an unbound slot (from ``alloc`` or ``evict``) to the free list."""
        self._free.append(slot)

    def drop(self, key: BlockHash) -> None:
        """Unbind ``key``; its slot goes back to the free list."""
        slot = self.keys.drop(key)
        if slot is not None:
            self._free.append(slot)
