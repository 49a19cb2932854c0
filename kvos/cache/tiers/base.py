"""The tier interface and its counters."""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Protocol

from kvos.cache.block import BlockHash
from kvos.cache.tiers.codec import PLAIN, Codec


@dataclass
class TierStats:
    hits_blocks: int = 0
    misses_blocks: int = 0
    loads_bytes: int = 0
    load_seconds: float = 0.0
    stores_blocks: int = 0
    stores_bytes: int = 0
    store_seconds: float = 0.0
    evictions: int = 0
    checksum_failures: int = 0
    errors: int = 0
    skipped_writes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class EvictedFrameListener(Protocol):
    """Hears a tier's evictions (write-back's demotion to the next tier, ``TierHierarchy``)."""

    def frame_evicted(self, tier: Tier, key: BlockHash, frame: bytes | memoryview) -> None:
        """``key``'s frame left ``tier`` (decode it with ``tier.codec`` and ``key``); the frame is
        valid only during the call."""


class Tier(ABC):
    """A byte store keyed by block hash, with its own capacity and eviction (LRU; the CPU tier: a policy).

    Thread-safe: the engine's background I/O thread and the scheduler both call it. ``get``
    returns verified payloads only: a frame is verified against the key it is read under
    (``codec``), so a corrupt, truncated, swapped, stale-format or foreign block (or, for a
    sealed codec, one written with another encryption key) is a miss, counted in
    ``stats.checksum_failures``, and its entry is dropped so that ``contains`` stops claiming
    it. Errors never propagate: a failing tier answers "miss" and counts the error.
    A payload from ``get`` may alias the tier's memory (``CPUTier``): it is valid only until the
    next ``put`` into the same tier.
    """

    name = "tier"
    receives_stores = True
    """False: the engine's own blocks are never stored here (write policy, promotions); only
    another engine's transferred blocks are (``TransferTier``)."""

    def __init__(self, capacity_bytes: int, codec: Codec = PLAIN) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{self.name} tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        """Frames payloads bound to their key; the disk and Redis tiers may use a sealed one."""
        self.stats = TierStats()
        self.lock = threading.RLock()
        self.eviction_listeners: list[EvictedFrameListener] = []
        """Told of every evicted key and its frame (``add_eviction_listener``)."""

    def add_eviction_listener(self, listener: EvictedFrameListener) -> None:
        """Tell ``listener`` of every eviction from now on (the hierarchy, built after its tiers)."""
        self.eviction_listeners.append(listener)

    @abstractmethod
    def contains(self, key: BlockHash) -> bool: ...

    def contains_many(self, keys: list[BlockHash]) -> list[bool]:
        """``contains`` of each of ``keys``, in order, in one batch: a remote tier answers in one
        round trip (a down tier answers all False). May block on I/O: call it off the engine
        thread (``OffloadManager.lookup``)."""
        return [self.contains(k) for k in keys]

    @abstractmethod
    def _read(self, key: BlockHash) -> bytes | memoryview | None:
        """The stored frame of ``key`` (see ``codec``), or None."""

    @abstractmethod
    def _write(self, key: BlockHash, data: bytes | memoryview, digest: int | None = None,
               parent: BlockHash | None = None) -> bool:
        """Store the frame of payload ``data`` bound to ``key`` (``self.codec``; ``digest``: the
        payload's ``block_digests`` value if the caller has it, used by a ``DigestCodec``;
        ``parent``: the key of the block before it in its chain, if known, which the CPU tier's
        eviction uses); False (counted) when skipped."""

    @abstractmethod
    def _drop(self, key: BlockHash) -> None: ...

    @abstractmethod
    def used_bytes(self) -> int: ...

    def _read_for_load(self, key: BlockHash) -> bytes | memoryview | None:
        """``_read`` for a load, which tells the tier of its hits afterwards (``note_hits``): a
        tier whose eviction learns from hits reads here without counting one."""
        return self._read(key)

    def note_hits(self, keys: list[BlockHash]) -> None:
        """A load took the leading ``keys`` (a chain, root first) from this tier, found with
        ``get_for_load`` and verified: one use of the chain for a tier whose eviction learns from
        hits (the CPU tier's policy). No-op here. Same thread rule as ``put``."""

    def get(self, key: BlockHash) -> bytes | memoryview | None:
        """Safe to call from several threads at once (the checksum runs outside the lock, and
        xxh3 releases the GIL); times itself into ``stats.load_seconds``."""
        return self._get(key, self._read)

    def _get(self, key: BlockHash, read) -> bytes | memoryview | None:
        t0 = time.perf_counter()
        blob = read(key)
        data = None if blob is None else self.codec.decode(key, blob)
        if blob is not None and data is None:
            self._drop(key)
        with self.lock:
            self.stats.load_seconds += time.perf_counter() - t0
            if blob is None:
                self.stats.misses_blocks += 1
            elif data is None:
                self.stats.checksum_failures += 1
            else:
                self.stats.hits_blocks += 1
                self.stats.loads_bytes += len(data)
        return data

    def get_for_load(self, key: BlockHash) -> tuple[bytes | memoryview, int | None] | None:
        """(payload, None) as ``get`` returns it, or for a tier whose frames hold a digest
        (``DigestCodec``) (the *unverified* payload, the digest it must have): the loader checks
        it after copying and calls ``reject`` if it differs. Same safety rules as ``get``. The
        loader calls ``note_hits`` for the chain it took."""
        data = self._get(key, self._read_for_load)
        return None if data is None else (data, None)

    def reject(self, key: BlockHash, nbytes: int) -> None:
        """A payload from ``get_for_load`` failed its digest: drop the entry and count it (on the
        thread that puts into this tier)."""
        self._drop(key)
        with self.lock:
            self.stats.checksum_failures += 1
            self.stats.hits_blocks -= 1
            self.stats.loads_bytes -= nbytes

    def put(self, key: BlockHash, data: bytes | memoryview, digest: int | None = None,
            parent: BlockHash | None = None) -> bool:
        if self.contains(key):
            return True
        ok = self._write(key, data, digest, parent)
        if ok:
            self.stats.stores_blocks += 1
            self.stats.stores_bytes += len(data)
        return ok

    def usage(self) -> dict:
        used = self.used_bytes()
        return {"name": self.name, "used_bytes": used, "capacity_bytes": self.capacity_bytes,
                "usage": used / self.capacity_bytes, **self.stats.as_dict()}
