"""A CPU tier below the simulated device: which block hashes host memory holds, managed by the
engine's own ``BlockPool`` and eviction policies, and when a load over the host link ends."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvos.cache.block import BlockHash, KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.eviction import make_policy, online_policies
from kvos.cache.listener import CachedBlocks
from kvos.cache.tiers.hierarchy import WRITE_POLICIES

CPU_SOURCE = "cpu"


@dataclass
class SimTierConfig:
    num_blocks: int
    """Host-memory slots, in device blocks."""
    policy: str = "lru"
    write_policy: str = "write_through"
    load_bandwidth: float = 46e9
    """Bytes/s of a tier-to-device load: kvos's measured CPU-tier load rate on an H100 host
    (44.6–47.3 GB/s in three runs, digests checked on the device, against 54.8–55.0 GB/s pinned
    host-to-device; ``kvos bench tier-bandwidth``, 2026-11-27)."""
    lookahead: int = 1024
    """Waiting requests whose tier blocks are evicted last, farthest in the queue first (0: the
    tier's policy alone); the engine's ``tier_lookahead``."""

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"tier num_blocks must be >= 1, got {self.num_blocks}")
        if self.policy not in online_policies():
            raise ValueError(f"tier policy must be one of {list(online_policies())}, "
                             f"got {self.policy!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"tier write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.lookahead < 0:
            raise ValueError(f"tier lookahead must be >= 0, got {self.lookahead}")
        if self.load_bandwidth <= 0:
            raise ValueError(f"tier load_bandwidth must be > 0, got {self.load_bandwidth}")


class SimTier:
    """Host memory as a second ``BlockPool`` whose slots hold copies of device blocks by hash.

    Wiring: the tier is its own pool's owner (``PoolOwner``: it holds the slots waiting requests
    will hit before that pool evicts) and a listener of the device pool (``BlockPoolListener``,
    added by the simulator): write-through stores the blocks a step registered (``after_step``),
    write-back stores each block the device evicts.

    Invariants (those of ``BlockPool``): every slot is unreferenced between calls, so every
    stored block is evictable by the tier's policy; chain order holds, so the tier never drops
    a block before the stored blocks that extend it. Loads are serialized on one host link:
    each ends ``bytes / load_bandwidth`` after the previous one (or its dispatch).
    """

    def __init__(self, config: SimTierConfig, block_size: int, block_bytes: float) -> None:
        self.cfg = config
        policy = make_policy(config.policy, capacity=config.num_blocks, block_size=block_size)
        self.pool = BlockPool(config.num_blocks + 1, policy=policy, owner=self)  # +1: the null block
        self._computed = CachedBlocks() if config.write_policy == "write_through" else None
        self.block_bytes = block_bytes
        self.link_free_at = 0.0
        self.stored = self.loaded = self.dropped = 0
        self.busy_s = 0.0
        self.demand: Callable[[int], Iterable[list[BlockHash]]] | None = None
        """The block hashes of the next ``n`` waiting requests, in queue order (set by the
        simulator when ``lookahead`` is on); read at a step's first tier eviction."""
        self._held = False

    # -- PoolOwner of the tier's pool -----------------------------------------------------
    def before_evict(self, group: int) -> None:
        """Hold the slots the next ``lookahead`` waiting requests will hit (once a step)."""
        if self._held or self.demand is None or not self.cfg.lookahead:
            return
        self._held = True
        index = self.pool.index
        for rank, hashes in enumerate(self.demand(self.cfg.lookahead)):
            run: list[KVBlock] = []
            for h in hashes:
                b = index.get(h)
                if b is not None:
                    run.append(b)
                elif run:
                    self.pool.hold(run, rank)
                    run = []
            if run:
                self.pool.hold(run, rank)

    def reclaim(self, group: int) -> bool:
        return self.pool.evict_one()

    # -- BlockPoolListener of the device pool ---------------------------------------------
    def block_cached(self, group: int, block: KVBlock, adopted: bool) -> None:
        if self._computed is not None:
            self._computed.block_cached(group, block, adopted)

    def block_evicting(self, group: int, block: KVBlock) -> None:
        if self._computed is None:  # write-back: the device's evicted block goes to the tier
            self.store(block)

    def after_step(self) -> None:
        """Write-through: store the blocks the step registered (still cached); then forget the
        step's demand."""
        if self._computed is not None:
            self.store_batch([block for _, block in self._computed.drain()])
        self.end_step()

    def end_step(self) -> None:
        """Forget the step's demand: held slots go back to the tier's policy."""
        if self._held:
            self._held = False
            self.pool.release_held()

    def lookup(self, request: object, hashes: list[BlockHash]) -> int:
        """How many leading ``hashes`` (of ``request``'s prompt) the tier holds, answered at once
        (the scheduler's lower-tier lookup); no recency update: a lookup may be repeated while
        the request waits for device room."""
        n = 0
        index = self.pool.index
        for h in hashes:
            if index.get(h) is None:
                break
            n += 1
        return n

    def store(self, block: KVBlock) -> None:
        """Copy a cached device block (write-through after it is computed, write-back when the
        device evicts it); a hash already held counts as a use."""
        assert block.block_hash is not None
        pool = self.pool
        held = pool.index.get(block.block_hash)
        if held is not None:
            pool.note_uses([held])
            return
        evicted_before = pool.counters.evictions
        [slot] = pool.get_new_blocks(1)
        self.dropped += pool.counters.evictions - evicted_before
        self._bind([(slot, block)])

    def store_batch(self, blocks: list[KVBlock]) -> None:
        """Write-through of a step's blocks as the engine's CPU tier takes them
        (``TierIO.store_computed``): the policy is told of the batch (``expect``), each block's
        slot is taken in order, evicting as needed, and the batch is bound (cached, freed) only
        after every slot is taken. A round ends early, its blocks bound first, when only blocks
        waiting requests want could make room, and at a hash held already, which then counts
        as a use (as ``store`` counts it)."""
        pool = self.pool
        pool.evictor.expect([b.block_hash for b in blocks])
        taken: list[tuple[KVBlock, KVBlock]] = []
        for block in blocks:
            assert block.block_hash is not None
            held = pool.index.get(block.block_hash)
            if held is not None:  # a use at its turn, after this round's blocks are bound
                self._bind(taken)
                taken = []
                pool.note_uses([held])
                continue
            if taken and not len(pool.plain_free):
                self.before_evict(pool.group)
                if not len(pool.evictor):  # only wanted blocks could go: this round's blocks first
                    self._bind(taken)
                    taken = []
            evicted_before = pool.counters.evictions
            [slot] = pool.get_new_blocks(1)
            self.dropped += pool.counters.evictions - evicted_before
            taken.append((slot, block))
        self._bind(taken)

    def _bind(self, taken: list[tuple[KVBlock, KVBlock]]) -> None:
        for slot, block in taken:
            self.pool.cache_full_block(slot, block.block_hash, block.parent_hash, block.depth, block.priority)
            self.pool.free_blocks([slot])
            self.stored += 1

    def load(self, hashes: list[BlockHash], now: float) -> tuple[int, float]:
        """Start loading the leading ``hashes`` still held (earlier stores may have evicted some
        since the lookup): how many, and when the copy ends."""
        blocks = []
        for h in hashes:
            b = self.pool.index.get(h)
            if b is None:
                break
            blocks.append(b)
        if blocks:  # a hit: the policy sees the use, root first, then the chain goes back tail first
            self.pool.note_uses(blocks)
        self.loaded += len(blocks)
        seconds = len(blocks) * self.block_bytes / self.cfg.load_bandwidth
        self.busy_s += seconds
        self.link_free_at = max(now, self.link_free_at) + seconds
        return len(blocks), self.link_free_at

    def report(self) -> dict:
        return {"tier_blocks": self.cfg.num_blocks, "tier_policy": self.cfg.policy,
                "tier_write_policy": self.cfg.write_policy, "tier_lookahead": self.cfg.lookahead, "tier_stored_blocks": self.stored,
                "tier_loaded_blocks": self.loaded, "tier_evictions": self.dropped,
                "tier_load_busy_s": self.busy_s}
