"""The ordered tiers below the device and the write policy that feeds them."""
from __future__ import annotations

import time

from kvos.cache.block import BlockHash
from kvos.cache.tiers.base import Tier

WRITE_POLICIES = ("write_through", "write_back")


class TierHierarchy:
    """Tiers fastest first (cpu, disk, remote).

    ``write_through``: a block is stored in every tier as soon as its KV is computed.
    ``write_back``: a block goes to the first tier only when the device evicts it, and from each
    tier to the next only when that tier evicts it.
    Lookups walk a request's block hashes in order and stop at the first block no tier holds.
    """

    def __init__(self, tiers: list[Tier], write_policy: str = "write_through") -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.tiers = tiers
        self.write_policy = write_policy
        if write_policy == "write_back":
            for upper in tiers[:-1]:
                upper.add_eviction_listener(self)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def frame_evicted(self, tier: Tier, key: BlockHash, frame: bytes | memoryview) -> None:
        """Write-back: demote a frame evicted from ``tier`` to the next tier
        (``EvictedFrameListener``)."""
        self._demote(tier, self.tiers[self.tiers.index(tier) + 1], key, frame)

    @staticmethod
    def _demote(upper: Tier, lower: Tier, key: BlockHash, blob: bytes | memoryview) -> None:
        """Write an evicted frame of ``upper`` to ``lower``, only if it verifies under ``key``."""
        data = upper.codec.decode(key, blob)
        if data is None:
            upper.stats.checksum_failures += 1
        else:
            lower.put(key, data)

    def lookup(self, hashes: list[BlockHash]) -> int:
        """How many leading ``hashes`` some tier holds. One ``contains_many`` batch per tier,
        fastest first, each asked only about the hashes from the first one no faster tier
        holds (so a remote tier costs at most one round trip, and none when faster tiers hold
        them all). May block on a slow tier: the engine calls it on its tier I/O thread only."""
        held = [False] * len(hashes)
        for tier in self.tiers:
            first = held.index(False) if False in held else len(held)
            ask = [i for i in range(first, len(hashes)) if not held[i]]
            if not ask:
                break
            for i, there in zip(ask, tier.contains_many([hashes[i] for i in ask])):
                held[i] = held[i] or there
        return held.index(False) if False in held else len(held)

    def held(self, keys: list[BlockHash]) -> list[bool]:
        """Per key, whether some tier holds it: one ``contains_many`` batch per tier, fastest
        first, each asked only about the keys no faster tier holds. For a caller whose rule is
        not "leading keys" (sliding-window groups need only a window's blocks). Blocks like
        ``lookup``: tier I/O thread only."""
        out = [False] * len(keys)
        for tier in self.tiers:
            ask = [i for i, there in enumerate(out) if not there]
            if not ask:
                break
            for i, there in zip(ask, tier.contains_many([keys[i] for i in ask])):
                out[i] = there
        return out

    def find(self, key: BlockHash) -> tuple[bytes | memoryview, int, int | None] | None:
        """The payload of ``key``, the index of the fastest tier holding it and the digest the
        caller must check it against (None: verified already; see ``Tier.get_for_load``), or
        None. Writes no tier memory (no promotion; a failed checksum only unbinds the entry), so
        a payload that aliases a tier's memory stays valid until the next store or ``promote``
        (see ``Tier.get``), and several finds may run at once."""
        for i, tier in enumerate(self.tiers):
            got = tier.get_for_load(key)
            if got is not None:
                return got[0], i, got[1]
        return None

    def promote(self, key: BlockHash, data: bytes | memoryview, found_in: int, digest: int | None = None) -> None:
        """Copy a block found in tier ``found_in`` into the tiers above it (may evict there)."""
        for upper in self.tiers[:found_in]:
            if upper.receives_stores:
                upper.put(key, data, digest)

    def store(self, key: BlockHash, data: bytes | memoryview, evicted: bool, digest: int | None = None,
              parent: BlockHash | None = None) -> None:
        """Called when a device block is computed (``evicted=False``) or evicted (True);
        ``parent``: the key of the block before it in its chain."""
        if self.write_policy == "write_through":
            targets = [] if evicted else self.tiers
        else:
            targets = [t for t in self.tiers if t.receives_stores][:1] if evicted else []
        for tier in targets:
            if not tier.receives_stores:
                continue
            t0 = time.perf_counter()
            tier.put(key, data, digest, parent)
            tier.stats.store_seconds += time.perf_counter() - t0

    def usage(self) -> list[dict]:
        return [t.usage() for t in self.tiers]
