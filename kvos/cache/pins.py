"""Pinned prefixes: cached full blocks that a pin holds a reference on, so no policy evicts them.

Pure Python (no torch). A pin is a reference like a running request's: while pinned a block is
``used``, never offered to the eviction policy, and still shared by prefix hits. Pins have an
id, a tenant (the cache salt, so one tenant's pin serves only that tenant), an optional expiry
on a caller-supplied clock, and count against a cap of the pool's blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvos.cache.block import KVBlock
from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.cache.kv_manager import KVCacheManager


@dataclass
class Pin:
    pin_id: str
    cache_salt: str | None
    group_blocks: list[list[KVBlock]]
    """Per cache group, the blocks of the prefix that group needs (a sliding-window group only
    those inside the window at the prefix's end, as a prefix hit needs them)."""
    num_tokens: int
    expires_at: float | None  # on the registry's clock; None: until unpinned

    @property
    def blocks(self) -> list[KVBlock]:
        """Every group's pinned blocks, group by group."""
        return [b for blocks in self.group_blocks for b in blocks]

    def describe(self) -> dict:
        return {"pin_id": self.pin_id, "pinned_tokens": self.num_tokens, "pinned_blocks": len(self.blocks),
                "expires_at": self.expires_at}


@dataclass
class PinInfo:
    """What a client is told of a pin (plain, picklable: it crosses to a server process)."""

    pin_id: str
    num_tokens: int
    num_blocks: int
    expires_in_s: float | None
    """Seconds left when this was made; None: until unpinned."""

    @classmethod
    def of(cls, pin: Pin, now: float) -> PinInfo:
        left = None if pin.expires_at is None else max(0.0, pin.expires_at - now)
        return cls(pin.pin_id, pin.num_tokens, len(pin.blocks), left)


class PinnedPrefixes:
    """Pins over a ``KVCacheManager`` of any number of cache groups.

    A pin holds, in every group, the blocks a prefix hit of the pinned prefix needs (the prefix
    cache's own rule, ``KVCacheManager.prefix_blocks``: every block of a full-attention group,
    the window's at the prefix's end in a sliding-window group), so a later request whose
    prompt starts with the prefix hits all of it.

    Invariants: every block of a live pin has ``ref_cnt >= 1`` from that pin; in each group the
    distinct blocks of all pins are at most ``max_blocks[group]`` (``max_fraction`` of the
    blocks that group could hold). Safety rule: call ``expire`` from the thread that owns the
    manager (the engine's), like every other manager call.
    """

    def __init__(self, kv: KVCacheManager, max_fraction: float) -> None:
        self.kv = kv
        self.max_group_blocks = [int(max_fraction * p.num_usable_blocks) for p in kv.pools]
        self.pins: dict[str, Pin] = {}
        self._holders: dict[tuple[int, int], int] = {}  # (group, block_id) -> number of pins holding it

    @property
    def max_blocks(self) -> int:
        """The cap of the first group (the only one, for most models)."""
        return self.max_group_blocks[0]

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._holders)

    def pin(self, pin_id: str, token_ids: list[int], cache_salt: str | None, now: float,
            ttl_s: float | None) -> Pin:
        """Pin the cached full blocks of ``token_ids`` for ``cache_salt``'s tenant (all of them
        must be cached: compute the prompt first). Re-pinning an id replaces its pin."""
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        hashes: list = []
        extend_block_hashes(hashes, token_ids, self.kv.block_size, root_hash(self.kv.model_id, cache_salt))
        if not hashes:
            raise ValueError(f"prompt: a pin needs at least one full block ({self.kv.block_size} tokens)")
        hits = self.kv.prefix_blocks(hashes, len(hashes))
        if len(hits[0]) < len(hashes):
            raise ValueError(f"prompt: only {len(hits[0]) * self.kv.block_size} of its "
                             f"{len(hashes) * self.kv.block_size} full-block tokens are cached; compute it first")
        group_blocks = [[b for b in hit if not b.is_null] for hit in hits]
        old = self.pins.get(pin_id)
        held = set(self._holders)
        if old is not None:
            held -= {(g, b.block_id) for g, blocks in enumerate(old.group_blocks) for b in blocks
                     if self._holders[(g, b.block_id)] == 1}
        held |= {(g, b.block_id) for g, blocks in enumerate(group_blocks) for b in blocks}
        for g, cap in enumerate(self.max_group_blocks):
            total = sum(1 for group, _ in held if group == g)
            if total > cap:
                raise ValueError(f"prompt: pinning {len(group_blocks[g])} blocks would hold {total} pinned blocks"
                                 f"{f' in cache group {g}' if len(self.max_group_blocks) > 1 else ''}, over the "
                                 f"cap of {cap} (max_pinned_fraction of {self.kv.pools[g].num_usable_blocks})")
        for g, blocks in enumerate(group_blocks):
            self.kv.pools[g].touch(blocks)
            for b in blocks:
                self._holders[(g, b.block_id)] = self._holders.get((g, b.block_id), 0) + 1
        if old is not None:
            self._release(old)
        pin = Pin(pin_id, cache_salt, group_blocks, len(hashes) * self.kv.block_size,
                  None if ttl_s is None else now + ttl_s)
        self.pins[pin_id] = pin
        return pin

    def unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        self._release(pin)
        return True

    def expire(self, now: float) -> list[str]:
        """Drop the pins whose time is up; returns their ids."""
        gone = [p.pin_id for p in self.pins.values() if p.expires_at is not None and p.expires_at <= now]
        for pin_id in gone:
            self.unpin(pin_id)
        return gone

    def _release(self, pin: Pin) -> None:
        for g, blocks in enumerate(pin.group_blocks):
            for b in blocks:
                left = self._holders[(g, b.block_id)] - 1
                if left:
                    self._holders[(g, b.block_id)] = left
                else:
                    del self._holders[(g, b.block_id)]
            self.kv.pools[g].free_blocks(reversed(blocks))
