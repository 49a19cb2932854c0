"""The tier interface and its counters."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvos.cache.block import BlockHash
from kvos.cache.tiers.codec import decode, encode


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


class Tier(ABC):
    """A byte store keyed by block hash, with its own capacity and LRU eviction.

    Thread-safe: the engine's background I/O thread and the scheduler both call it. ``get``
    returns verified payloads only; a failed checksum is a miss (counted) and the entry is
    dropped. Errors never propagate: a failing tier answers "miss" and counts the error.
    """

    name = "tier"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{self.name} tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.lock = threading.RLock()
        self.on_evict: Callable[[BlockHash, bytes], None] | None = None  # write-back to the next tier

    @abstractmethod
    def contains(self, key: BlockHash) -> bool: ...

    @abstractmethod
    def _read(self, key: BlockHash) -> bytes | None: ...

    @abstractmethod
    def _write(self, key: BlockHash, blob: bytes) -> bool: ...

    @abstractmethod
    def _drop(self, key: BlockHash) -> None: ...

    @abstractmethod
    def used_bytes(self) -> int: ...

    def get(self, key: BlockHash) -> bytes | memoryview | None:
        blob = self._read(key)
        if blob is None:
            self.stats.misses_blocks += 1
            return None
        data = decode(blob)
        if data is None:
            self.stats.checksum_failures += 1
            self._drop(key)
            return None
        self.stats.hits_blocks += 1
        self.stats.loads_bytes += len(data)
        return data

    def put(self, key: BlockHash, data: bytes | memoryview) -> bool:
        if self.contains(key):
            return True
        ok = self._write(key, encode(data))
        if ok:
            self.stats.stores_blocks += 1
            self.stats.stores_bytes += len(data)
        return ok

    def usage(self) -> dict:
        used = self.used_bytes()
        return {"name": self.name, "used_bytes": used, "capacity_bytes": self.capacity_bytes,
                "usage": used / self.capacity_bytes, **self.stats.as_dict()}
