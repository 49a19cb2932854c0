"""The keys bound to a ``SlotArena``'s slots and the order they leave in: an eviction policy of
``kvos.cache.eviction`` (the objects the device pool and the simulated tier use), with the
waiting queue's demand held back the way ``BlockPool.hold`` holds it."""
from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvos.cache.block import BlockHash, KVBlock
from kvos.cache.eviction import EvictionPolicy

Demand = dict[BlockHash, tuple[int, int]]
"""Per block hash a waiting request will hit: (its first waiting user's queue position, the
block's position in that request's chain)."""


class SlotKeys:
    """Which key each bound slot holds, and which key goes first.

    Each bound key is a ``KVBlock`` record (block id: its slot; block hash: the key; parent
    hash: the key of the block before it in its chain, when the store named it) that the policy
    sees as ``BlockPool`` shows it a cached block freed by a request: ``bind`` ticks the
    record's ``cached_at``, then its ``last_used``, and offers it (``add``); a hit (``lookup``)
    is a prefix hit followed by the hitting request's free: ``on_hit`` at a new tick, out of the
    policy (``remove``), ``num_hits`` + 1, ``last_used`` ticked, back in (``add``); a load's
    chain is one such hit (``hit_chain``: the uses root first, the frees tail first). A record has
    no depth, priority or kind (``weighted`` reduces to hit counts with aging). With ``lru``
    and no parents this is an LRU list in which a bind or a hit moves a key to the end.

    Chain order (``BlockPool``'s, so the policy decides as the simulated tier's does): a key
    with bound children is parked, out of the policy, and comes back (``add``) when its last
    child leaves; the policy chooses only among the chains' last blocks, and a chain is never
    cut before the blocks that extend it. A hit on a parked key is heard (``on_hit``, its use
    counted) and leaves it parked, as a hit on a whole chain in the simulated tier touches the
    chain and frees it tail first.

    Demand (``set_demand``): at the first ``evict`` after the demand changed, the keys held for
    the old demand go back to the policy (``restore``, or ``add`` for a key bound or hit while
    held, so that the policy counts that use) and every bound key the new demand names is taken
    out of it (held; a parked one when its children go): O(demand) once per change. A key
    bound while the applied demand names it is held at once; a held key stays held after a hit.

    ``evict`` takes the policy's choice; only when the policy holds no key does it take a held
    one: the one wanted farthest back in the queue, deepest in its chain first, least recently
    used first among equals (``BlockPool.evict_held``'s rule).

    Invariant: every bound key is in exactly one of the policy, the held and the parked; a key
    is parked exactly when it has bound children. Not thread-safe: the owner's lock guards it
    (``CPUTier``).
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.slots: dict[BlockHash, int] = {}
        """Bound key -> its slot."""
        self.demand: Demand = {}
        self._records: dict[int, KVBlock] = {}  # slot -> its record (reused, like a pool's blocks)
        self._clock = 0
        self._held: dict[int, KVBlock] = {}  # slot -> record taken out of the policy for _held_for
        self._held_order: list[tuple[int, int, int, int]] = []  # heap of (-rank, -depth, last_used, slot)
        self._unoffered: set[int] = set()  # held slots that go back with ``add`` (bound or hit while held)
        self._held_for: Demand | None = None  # the demand applied (None: none yet)
        self._parked: dict[int, KVBlock] = {}  # slot -> record with bound children, out of the policy
        self._children: dict[BlockHash, int] = {}  # key -> its bound children (the key bound or not)

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.slots

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self.slots)

    def set_demand(self, demand: Demand) -> None:
        """The waiting queue's wanted keys from now on (replaces the previous demand, applied at
        the next ``evict``; the mapping must not be mutated afterwards)."""
        self.demand = demand

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def bind(self, key: BlockHash, slot: int, parent: BlockHash | None = None) -> None:
        """``key`` (not bound) now lives in ``slot`` (free: from ``alloc`` or ``evict``);
        ``parent``: the key of the block before it in its chain (None: a root, or not known)."""
        if key in self.slots:
            raise ValueError(f"key {key.hex()} is bound already")
        record = self._records.get(slot)
        if record is None:
            record = self._records[slot] = KVBlock(slot)
        record.block_hash = key
        record.parent_hash = parent
        record.cached_at = self._tick()
        record.last_used = self._tick()
        self.slots[key] = slot
        if self._children.get(key):  # its children came first (stored on another copy of it)
            self._parked[slot] = record
        elif self._held_for is self.demand and key in self.demand:
            self._unoffered.add(slot)
            self._hold(record, self.demand[key])
        else:
            self.policy.add(record)
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            pslot = self.slots.get(parent)
            if pslot is not None and pslot not in self._parked:
                precord = self._records[pslot]
                if self._held.pop(pslot, None) is None:
                    self.policy.remove(precord)
                self._unoffered.discard(pslot)
                self._parked[pslot] = precord

    def lookup(self, key: BlockHash) -> int | None:
        """The slot holding ``key``, or None; a hit, which the policy hears (``hit_chain``)."""
        slot = self.slots.get(key)
        if slot is not None:
            self.hit_chain([key])
        return slot

    def num_hits(self, key: BlockHash) -> int:
        """The hits the policy has heard for bound ``key`` since it was bound (0 if unbound)."""
        slot = self.slots.get(key)
        return 0 if slot is None else self._records[slot].num_hits

    def hit_chain(self, keys: list[BlockHash]) -> int:
        """A load took the leading bound ``keys`` (a chain, root first) as one use: the policy
        hears each hit at one time, root first (``on_hit``), the ones in it leave it, and they
        come back tail first with their new last use (``add``), as ``BlockPool.touch`` then
        ``free_blocks`` show a request's prefix hit. A parked key stays parked, a held one held
        (re-queued by its new last use). Returns how many keys were bound (stops at the first
        that is not)."""
        taken: list[tuple[BlockHash, int, KVBlock, bool]] = []
        now = 0
        for key in keys:
            slot = self.slots.get(key)
            if slot is None:
                break
            now = now or self._tick()  # no hit, no tick
            record = self._records[slot]
            self.policy.on_hit(record, now)
            in_policy = slot not in self._parked and slot not in self._held
            if in_policy:
                self.policy.remove(record)
            record.num_hits += 1
            record.last_used = now
            taken.append((key, slot, record, in_policy))
        for key, slot, record, in_policy in reversed(taken):
            record.last_used = self._tick()
            if slot in self._held:  # offered with ``add`` on release
                self._unoffered.add(slot)
                assert self._held_for is not None
                self._hold(record, self._held_for[key])
            elif in_policy:
                self.policy.add(record)
        return len(taken)

    def evict(self, wanted: bool = True) -> tuple[BlockHash, int] | None:
        """Unbind the policy's choice among the keys no waiting request wants (else, if
        ``wanted``, the held key wanted farthest back; else None): (key, its slot). KeyError if
        no key is bound."""
        if self._held_for is not self.demand:
            self._apply_demand()
        if len(self.policy):
            record = self.policy.pop()
        elif not self._held:
            raise KeyError("no key is bound")
        elif not wanted:
            return None
        else:
            record = self._pop_held()
        return self._unbind(record)

    def drop(self, key: BlockHash) -> int | None:
        """Unbind ``key``: its slot (None if it was not bound)."""
        slot = self.slots.get(key)
        if slot is None:
            return None
        record = self._records[slot]
        if self._parked.pop(slot, None) is None and self._held.pop(slot, None) is None:
            self.policy.remove(record)
        self._unoffered.discard(slot)
        return self._unbind(record)[1]

    def _unbind(self, record: KVBlock) -> tuple[BlockHash, int]:
        key = record.block_hash
        assert key is not None
        del self.slots[key]
        self._child_left(record.parent_hash)
        record.block_hash = record.parent_hash = None
        record.num_hits = 0
        return key, record.block_id

    def _child_left(self, parent: BlockHash | None) -> None:
        """A child of ``parent`` was unbound: the parent, once childless, comes back to the
        policy (or is held, if the applied demand names it)."""
        if parent is None:
            return
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
            return
        del self._children[parent]
        pslot = self.slots.get(parent)
        if pslot is None or (precord := self._parked.pop(pslot, None)) is None:
            return
        if self._held_for is not None and parent in self._held_for:
            self._unoffered.add(pslot)
            self._hold(precord, self._held_for[parent])
        else:
            self.policy.add(precord)

    def _hold(self, record: KVBlock, want: tuple[int, int]) -> None:
        self._held[record.block_id] = record
        heapq.heappush(self._held_order, (-want[0], -want[1], record.last_used, record.block_id))

    def _pop_held(self) -> KVBlock:
        while True:
            _, _, last_used, slot = heapq.heappop(self._held_order)
            record = self._held.get(slot)
            if record is not None and record.last_used == last_used:  # else dropped, or hit and re-queued
                del self._held[slot]
                self._unoffered.discard(slot)
                return record

    def _apply_demand(self) -> None:
        """Give the old demand's held keys back to the policy; hold the new demand's bound keys."""
        for slot, record in self._held.items():
            if slot in self._unoffered:
                self.policy.add(record)
            else:
                self.policy.restore(record)
        self._held.clear()
        self._held_order.clear()
        self._unoffered.clear()
        demand = self._held_for = self.demand
        for key, want in demand.items():
            slot = self.slots.get(key)
            if slot is not None and slot not in self._parked:  # a parked one: held when its children go
                record = self._records[slot]
                self.policy.remove(record)
                self._hold(record, want)
