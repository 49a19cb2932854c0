"""CPU-memory tier: an LRU dictionary of framed blocks."""
from __future__ import annotations

from collections import OrderedDict

from kvos.cache.block import BlockHash
from kvos.cache.tiers.base import Tier


class CPUTier(Tier):
    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._blocks: OrderedDict[BlockHash, bytes] = OrderedDict()
        self._used = 0

    def contains(self, key: BlockHash) -> bool:
        with self.lock:
            return key in self._blocks

    def _read(self, key: BlockHash) -> bytes | None:
        with self.lock:
            blob = self._blocks.get(key)
            if blob is not None:
                self._blocks.move_to_end(key)
            return blob

    def _write(self, key: BlockHash, blob: bytes) -> bool:
        if len(blob) > self.capacity_bytes:
            self.stats.skipped_writes += 1
            return False
        with self.lock:
            while self._used + len(blob) > self.capacity_bytes:
                old_key, old = self._blocks.popitem(last=False)
                self._used -= len(old)
                self.stats.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(old_key, old)
            self._blocks[key] = blob
            self._used += len(blob)
        return True

    def _drop(self, key: BlockHash) -> None:
        with self.lock:
            blob = self._blocks.pop(key, None)
            if blob is not None:
                self._used -= len(blob)

    def used_bytes(self) -> int:
        return self._used

    def corrupt(self, key: BlockHash) -> None:
        """Flip a byte of a stored block (fault-injection for tests)."""
        with self.lock:
            blob = bytearray(self._blocks[key])
            blob[-1] ^= 0xFF
            self._blocks[key] = bytes(blob)
