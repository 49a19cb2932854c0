"""CPU-memory tier: framed blocks in the fixed-size slots of a ``SlotArena``."""
from __future__ import annotations

import logging
import threading
import time

from kvos.cache.block import BlockHash
from kvos.cache.eviction import online_policies
from kvos.cache.tiers.arena import (
    DEFAULT_CHUNK_BYTES,
    Allocate,
    Demand,
    SlotArena,
    allocate_bytearray,
)
from kvos.cache.tiers.base import Tier
from kvos.cache.tiers.codec import HEADER_SIZE, PLAIN, Digest, DigestCodec

log = logging.getLogger("kvos.tiers")


class CPUTier(Tier):
    """Each block is one slot holding its frame (magic, keyed checksum, length, payload), placed
    so that the payload starts 64-byte aligned. Process memory is not encrypted: the keyed
    checksum guards against corruption and blocks in the wrong slot. Memory comes from
    ``allocate`` in chunks as the tier fills (page-locked memory when the engine runs on a GPU, so
    loads DMA straight from slots).

    Frames are plain (xxh3 of key and payload, verified on the host by ``get``) unless
    ``digest_fn`` is given: then they hold the payload's ``block_digests`` value bound to the key
    (``DigestCodec``), which stores take from the caller (computed on the device before the copy
    to the host) and loads check on the device after their copy (``get_for_load``), so neither
    hashes the payload on a host thread.

    The slot size is fixed by the first block stored or by ``preallocate`` (the engine sizes
    slots for its largest cache group's block); a payload of at most that size is stored in a
    slot with a frame of its own length (a smaller group's block leaves the slot's tail
    unused), a larger one is not stored and counts in ``stats.skipped_writes``.

    Eviction: ``eviction_policy`` (one of ``online_policies``: the device pool's and the
    simulated tier's policy classes) orders the stored blocks; a get is a hit it hears; the
    blocks the waiting queue will hit (``set_demand``) go last (``SlotArena``, ``SlotKeys``).

    Safety rule: ``get`` returns a view of slot memory, valid only until the next ``put`` into
    this tier (a put may evict that slot and rewrite it; a get never writes a slot, so gets may
    run concurrently). The engine puts only on its single tier I/O thread; gets run there or on
    helper threads that thread waits for, and every view is finished with before its next put
    (``kvos.connector.tier_io``); other threads only call ``contains``.
    """

    name = "cpu"
    PAYLOAD_ALIGN = 64
    _LEAD = (-HEADER_SIZE) % PAYLOAD_ALIGN  # frame offset in a slot: header ends on the alignment

    def __init__(self, capacity_bytes: int, allocate: Allocate = allocate_bytearray,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, digest_fn: Digest | None = None,
                 eviction_policy: str = "lru") -> None:
        super().__init__(capacity_bytes, DigestCodec(digest_fn) if digest_fn is not None else PLAIN)
        if eviction_policy not in online_policies():
            raise ValueError(f"{self.name} tier eviction_policy must be one of {list(online_policies())}, "
                             f"got {eviction_policy!r}")
        self.eviction_policy = eviction_policy
        self.digests = digest_fn is not None
        """Frames carry a digest the loader checks (``get_for_load``), not an xxh3 checksum."""
        self.allocate = allocate
        self.chunk_bytes = chunk_bytes
        self.arena: SlotArena | None = None  # made by the first put that fits
        self._demand: Demand = {}
        self._reserved: dict[int, int] = {}  # reserved slot -> payload bytes its commit frames
        self.preallocated = threading.Event()
        """Set once ``preallocate`` has allocated every slot (never set without it)."""

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

    def _frame(self, slot: int, payload_bytes: int | None = None) -> memoryview:
        """The frame in ``slot``: for ``payload_bytes`` (a frame being written), else the length
        its header records (clamped to the slot)."""
        assert self.arena is not None
        whole = self.arena.view(slot)[self._LEAD:]
        if payload_bytes is None:
            payload_bytes = int.from_bytes(whole[HEADER_SIZE - 8: HEADER_SIZE], "little")
        return whole[: HEADER_SIZE + min(payload_bytes, len(whole) - HEADER_SIZE)]

    def payload_stride(self) -> int:
        """Bytes from one slot's payload to the next slot's in the same chunk (0 until the first
        store fixes the slot size)."""
        with self.lock:
            return self.arena.stride if self.arena is not None else 0

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

    def _read_for_load(self, key: BlockHash) -> memoryview | None:
        with self.lock:
            slot = self.arena.peek(key) if self.arena is not None else None
            return None if slot is None else self._frame(slot)

    def note_hits(self, keys: list[BlockHash]) -> None:
        with self.lock:
            if self.arena is not None:
                self.arena.keys.hit_chain(keys)

    def put(self, key: BlockHash, data: bytes | memoryview, digest: int | None = None,
            parent: BlockHash | None = None) -> bool:
        """As ``Tier.put``; a key stored already counts as a use (its content was needed
        again), as a store of a held hash does in the simulated tier."""
        return self.touch(key) or super().put(key, data, digest, parent)

    def get_for_load(self, key: BlockHash) -> tuple[memoryview, int | None] | None:
        if not self.digests:
            return super().get_for_load(key)
        t0 = time.perf_counter()
        blob = self._read_for_load(key)
        got = None if blob is None else self.codec.split(key, blob)
        if blob is not None and got is None:
            self._drop(key)
        with self.lock:
            self.stats.load_seconds += time.perf_counter() - t0
            if blob is None:
                self.stats.misses_blocks += 1
            elif got is None:
                self.stats.checksum_failures += 1
            else:
                self.stats.hits_blocks += 1
                self.stats.loads_bytes += len(got[0])
        return got

    def _sized(self, size: int) -> bool:
        """Whether slots are (now) ``size`` bytes: the first size asked for fixes them. Under
        ``self.lock``."""
        if self.arena is None:
            try:
                self.arena = SlotArena(size, self.capacity_bytes, self.allocate, self.chunk_bytes,
                                       self.PAYLOAD_ALIGN, self.eviction_policy)
            except ValueError:  # not even one slot of this size fits the capacity
                return False
            self.arena.set_demand(self._demand)
        return size <= self.arena.slot_bytes

    def _take_slot(self, size: int, evict_wanted: bool = True) -> int | None:
        """A slot of ``size`` bytes taken off the free list or from the block evicted (None,
        counted, when this size cannot be stored, or no slot is free and none is bound: all
        reserved, or none allocated yet; None, uncounted, when only a block a waiting request
        wants could go and not ``evict_wanted``). Under ``self.lock``."""
        if not self._sized(size):
            self.stats.skipped_writes += 1
            return None
        slot = self.arena.alloc()
        if slot is None:
            if not len(self.arena):
                self.stats.skipped_writes += 1
                return None
            got = self.arena.evict(evict_wanted)
            if got is None:
                return None
            old_key, slot = got
            self.stats.evictions += 1
            for listener in self.eviction_listeners:  # before the slot is rewritten
                listener.frame_evicted(self, old_key, self._frame(slot))
        return slot

    def size_slots(self, payload_bytes: int) -> None:
        """Size the slots for payloads of up to ``payload_bytes`` (the engine's largest cache
        group's block) before the first store, allocating them as the tier fills; a no-op if
        sized already."""
        with self.lock:
            self._sized(self._LEAD + HEADER_SIZE + payload_bytes)

    def preallocate(self, payload_bytes: int, background: bool = False) -> int:
        """Size the slots for payloads of ``payload_bytes`` and allocate all of them up front (the
        engine on a GPU: pinning memory is slow, and write-through must not wait for it in the
        middle of a run); returns the bytes allocated by then. A no-op if sized already.

        ``background``: a thread allocates the chunks, outside the tier's lock, and adds each as
        it is ready; meanwhile the tier stores into the slots it has (evicting when they are all
        bound) instead of growing itself. ``preallocated`` is set when it is done."""
        with self.lock:
            if self.arena is not None or not self._sized(self._LEAD + HEADER_SIZE + payload_bytes):
                self.preallocated.set()
                return 0 if self.arena is None else self.arena.reserved_bytes
            if not background:
                while self.arena.grow():
                    pass
                self.preallocated.set()
                return self.arena.reserved_bytes
            self.arena.grow_on_demand = False
        threading.Thread(target=self._grow_all, name="kvos-cpu-tier-pin", daemon=True).start()
        return 0

    def _grow_all(self) -> None:
        t0 = time.perf_counter()
        try:
            while True:
                with self.lock:
                    nbytes = self.arena.next_chunk_bytes()
                if not nbytes:
                    break
                mem = self.allocate(nbytes)  # slow (pinning): never under the lock
                with self.lock:
                    self.arena.add_chunk(mem)
        except Exception:  # out of pinnable memory, say: the tier keeps what it has
            log.exception("cpu tier: allocating its slots failed; it keeps %d bytes of them", self.arena.reserved_bytes)
        finally:
            with self.lock:
                self.arena.grow_on_demand = True
            self.preallocated.set()
        log.info("cpu tier: %.1f GiB of slots allocated in %.1f s (in the background)",
                 self.arena.reserved_bytes / 2**30, time.perf_counter() - t0)

    def _write(self, key: BlockHash, data: bytes | memoryview, digest: int | None = None,
               parent: BlockHash | None = None) -> bool:
        with self.lock:
            slot = self._take_slot(self._LEAD + HEADER_SIZE + len(data))
            if slot is None:
                return False
            frame = self._frame(slot, len(data))
            if self.digests:
                self.codec.encode_into(frame, key, data, digest)
            else:
                self.codec.encode_into(frame, key, data)
            self.arena.bind(key, slot, parent)
        return True

    def expect(self, keys: list[BlockHash]) -> None:
        """``keys`` are about to be reserved and committed as one batch: the policy keeps its
        memory of them (``EvictionPolicy.expect``) through the evictions that make their room."""
        with self.lock:
            if self.arena is not None:
                self.arena.policy.expect(keys)

    def reserve(self, key: BlockHash, nbytes: int, evict_wanted: bool = True) -> tuple[int, memoryview] | None | bool:
        """A slot for ``key``'s payload of ``nbytes`` bytes that the caller fills in place (a
        device-to-host copy straight into pinned slot memory): (slot, view of its payload); None
        when ``key`` is here already (a put would count a use: ``touch`` it, after committing
        the blocks reserved before it) or the size cannot be stored; False when only a block a
        waiting request wants could make room and not ``evict_wanted`` (a put would then
        evict the blocks reserved before it first: commit those, then reserve again). The
        slot is unbound, invisible to gets, until ``commit``. Same thread rule as ``put``."""
        with self.lock:
            if self.arena is not None and key in self.arena:
                return None
            size = self._LEAD + HEADER_SIZE + nbytes
            if self.arena is not None and size <= self.arena.slot_bytes and not evict_wanted:
                if not self.arena.has_free() and not len(self.arena):
                    return False  # every slot is reserved: the round's blocks go first
                slot = self._take_slot(size, evict_wanted=False)
                if slot is None:
                    return False
            else:
                slot = self._take_slot(size)
            if slot is None:
                return None
            self._reserved[slot] = nbytes
            return slot, self._frame(slot, nbytes)[HEADER_SIZE:]

    def touch(self, key: BlockHash) -> bool:
        """A block stored again (its content was needed again): a use, as ``put`` of a stored key
        counts one; False if ``key`` is not stored. Same thread rule as ``put``."""
        with self.lock:
            return self.arena is not None and self.arena.lookup(key) is not None

    def commit(self, key: BlockHash, slot: int, digest: int | None = None, parent: BlockHash | None = None) -> None:
        """Frame the payload written into a reserved slot and bind it to ``key`` (``digest``:
        its ``block_digests`` value, for digest frames; ``parent``: the key before it in its
        chain)."""
        with self.lock:
            nbytes = self._reserved.pop(slot)
        frame = self._frame(slot, nbytes)
        if self.digests:
            self.codec.write_header(frame, key, digest)
        else:
            self.codec.write_header(frame, key)
        with self.lock:
            self.arena.bind(key, slot, parent)
            self.stats.stores_blocks += 1
            self.stats.stores_bytes += len(frame) - HEADER_SIZE

    def release(self, slot: int) -> None:
        """Give back a reserved slot without storing anything."""
        with self.lock:
            self._reserved.pop(slot, None)
            self.arena.free(slot)

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
