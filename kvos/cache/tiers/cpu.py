"""CPU-memory tier: framed blocks in the fixed-size slots of a ``SlotArena``."""
from __future__ import annotations

from kvos.cache.block import BlockHash
from kvos.cache.tiers.arena import DEFAULT_CHUNK_BYTES, Allocate, Demand, SlotArena, allocate_bytearray
from kvos.cache.tiers.base import Tier
from kvos.cache.tiers.codec import HEADER_SIZE


class CPUTier(Tier):
    """Each block is one slot holding its plain frame (magic, checksum of key and payload,
    length, payload), placed so that the payload starts 64-byte aligned. Process memory is not
    encrypted: the keyed checksum guards against corruption and blocks in the wrong slot. Memory comes from ``allocate`` in chunks as the
    tier fills (pinned memory when the engine runs on a GPU, so loads DMA straight from slots).

    The slot size is fixed by the first block stored (an engine's blocks all have one size); a
    payload of another size is not stored and counts in ``stats.skipped_writes``.

    Safety rule: ``get`` returns a view of slot memory, valid only until the next ``put`` into
    this tier (a put may evict that slot and rewrite it; a get never writes a slot, so gets may
    run concurrently). The engine puts only on its single tier I/O thread; gets run there or on
    helper threads that thread waits for, and every view is finished with before its next put
    (``kvos.engine.tier_io``); other threads only call ``contains``.
    """

    name = "cpu"
    PAYLOAD_ALIGN = 64
    _LEAD = (-HEADER_SIZE) % PAYLOAD_ALIGN  # frame offset in a slot: header ends on the alignment

    def __init__(self, capacity_bytes: int, allocate: Allocate = allocate_bytearray,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(capacity_bytes)
        self.allocate = allocate
        self.chunk_bytes = chunk_bytes
        self.arena: SlotArena | None = None  # made by the first put that fits
        self._demand: Demand = {}

    def set_demand(self, demand: Demand) -> None:
        """Blocks the waiting queue will hit: evicted last (``SlotArena``). Any thread."""
        with self.lock:
            self._demand = demand
            if self.arena is not None:
                self.arena.set_demand(demand)

    def free_slots(self) -> int | None:
        """Slots not bound to a block (None before the first put sizes them)."""
        arena = self.arena
        return None if arena is None else arena.capacity_slots - len(arena)

    def _frame(self, slot: int) -> memoryview:
        assert self.arena is not None
        return self.arena.view(slot)[self._LEAD:]

    def contains(self, key: BlockHash) -> bool:
        with self.lock:
            return self.arena is not None and key in self.arena

    def contains_many(self, keys: list[BlockHash]) -> list[bool]:
        with self.lock:
            arena = self.arena
            return [arena is not None and k in arena for k in keys]

    def _read(self, key: BlockHash) -> memoryview | None:
        with self.lock:
            slot = self.arena.lookup(key) if self.arena is not None else None
            return None if slot is None else self._frame(slot)

    def _write(self, key: BlockHash, data: bytes | memoryview) -> bool:
        size = self._LEAD + HEADER_SIZE + len(data)
        with self.lock:
            if self.arena is None:
                try:
                    self.arena = SlotArena(size, self.capacity_bytes, self.allocate, self.chunk_bytes,
                                           self.PAYLOAD_ALIGN)
                    self.arena.set_demand(self._demand)
                except ValueError:  # not even one slot of this size fits the capacity
                    self.stats.skipped_writes += 1
                    return False
            if size != self.arena.slot_bytes:
                self.stats.skipped_writes += 1
                return False
            slot = self.arena.alloc()
            if slot is None:
                old_key, slot = self.arena.evict()
                self.stats.evictions += 1
                if self.on_evict is not None:  # before the slot is rewritten
                    self.on_evict(old_key, self._frame(slot))
            self.codec.encode_into(self._frame(slot), key, data)
            self.arena.bind(key, slot)
        return True

    def _drop(self, key: BlockHash) -> None:
        with self.lock:
            if self.arena is not None:
                self.arena.drop(key)

    def used_bytes(self) -> int:
        return 0 if self.arena is None else len(self.arena) * self.arena.stride

    def corrupt(self, key: BlockHash) -> None:
        """Flip a byte of a stored block (fault-injection for tests)."""
        with self.lock:
            assert self.arena is not None
            slot = self.arena.lookup(key)
            assert slot is not None, "no such block"
            frame = self._frame(slot)
            frame[-1] ^= 0xFF


class TransferTier(CPUTier):
    """Host slots for KV blocks that another engine computed and sent (disaggregated prefill:
    the decode engine's side). The engine looks them up and loads them like any tier's blocks,
    but never stores its own blocks here. Puts follow ``CPUTier``'s rule: on the engine's tier
    I/O thread only."""

    name = "transfer"
    receives_stores = False
