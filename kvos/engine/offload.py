"""Moves block bytes between the device pool and the tiers below it, off the step's path."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from kvos.cache.block import KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.tiers import CPUTier, DiskTier, RedisTier, TierHierarchy
from kvos.cache.tiers.codec import sealed_codec_from_file
from kvos.engine.scheduler import PrefixLoad, Scheduler
from kvos.engine.tier_io import LoadedBlocks, TierIO

GIB = 1 << 30


def build_hierarchy(cpu_cache_gb: float, disk_cache_dir: str | None, disk_cache_gb: float,
                    remote_cache: str | None, write_policy: str, pinned: bool = False,
                    encryption_key_file: str | None = None) -> TierHierarchy | None:
    """The configured tiers; ``pinned``: the CPU tier's slots are page-locked memory (the engine
    runs on a GPU); ``encryption_key_file`` (``EngineConfig.tier_encryption_key_file``): the disk
    and Redis tiers seal their blocks with AES-256-GCM under that key (the CPU tier, process
    memory, keeps plain keyed-checksum frames)."""
    tiers = []
    if cpu_cache_gb < 0 or disk_cache_gb <= 0:
        raise ValueError("cpu_cache_gb must be >= 0 and disk_cache_gb > 0")
    if cpu_cache_gb:
        if pinned:
            from kvos.engine.pinned import PinnedAllocator

            tiers.append(CPUTier(int(cpu_cache_gb * GIB), PinnedAllocator()))
        else:
            tiers.append(CPUTier(int(cpu_cache_gb * GIB)))
    codec = sealed_codec_from_file(encryption_key_file if disk_cache_dir or remote_cache else None)
    if disk_cache_dir:
        tiers.append(DiskTier(disk_cache_dir, int(disk_cache_gb * GIB), codec))
    if remote_cache:
        tiers.append(RedisTier(remote_cache, codec=codec))
    return TierHierarchy(tiers, write_policy) if tiers else None


class OffloadManager:
    """Device-side reads and writes happen on the engine thread (block bytes are only valid
    while the pool says so); tier I/O happens on one background thread (``TierIO`` explains why
    there must be exactly one).

    Safety rules: a computed block's bytes are read right after the step that registered it
    (write-through, all of the step's blocks in one batch) or inside the pool's eviction
    callback, before the block's new owner writes it (write-back); loaded bytes are written only
    into blocks of a request still LOADING.
    """

    def __init__(self, hierarchy: TierHierarchy, runner, pool: BlockPool, scheduler: Scheduler) -> None:
        self.h = hierarchy
        self.runner = runner
        self.pool = pool
        self.scheduler = scheduler
        self.tier_io = TierIO(hierarchy, runner)
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvos-tier-io")
        self.pending: list[tuple[PrefixLoad, Future[LoadedBlocks]]] = []
        scheduler.lower_tier_lookup = hierarchy.lookup
        if hierarchy.write_policy == "write_through":
            pool.newly_cached = []
        else:
            pool.on_evict = self._on_evict

    def _store(self, blocks: list[KVBlock], evicted: bool) -> None:
        rows = self.runner.read_blocks([b.block_id for b in blocks])
        self.io.submit(self.tier_io.store, [b.block_hash for b in blocks], rows, evicted)

    def _on_evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        self._store([block], True)

    def after_step(self) -> None:
        """Write-through: back up every block registered this step."""
        if self.pool.newly_cached:
            blocks = [b for b in self.pool.newly_cached if b.block_hash is not None]
            self.pool.newly_cached.clear()
            if blocks:
                self._store(blocks, False)

    def dispatch(self, loads: list[PrefixLoad]) -> None:
        for load in loads:
            self.pending.append((load, self.io.submit(self.tier_io.fetch, load.hashes)))

    def install_ready(self, block: bool = False) -> None:
        """Install finished loads (waiting for at least one if ``block``). A finished fetch's
        copies are complete (``TierIO.fetch``), so installing never waits for a transfer."""
        if not self.pending:
            return
        if block:
            wait([f for _, f in self.pending], return_when=FIRST_COMPLETED)
        still = []
        for load, fut in self.pending:
            if not fut.done():
                still.append((load, fut))
                continue
            try:
                got = fut.result()
            except Exception:  # e.g. no device memory for the staging rows: recompute
                got = None
            req = load.request
            if req.request_id not in self.scheduler.loading:
                continue  # aborted while loading: its blocks may belong to someone else now
            if got is not None:
                self.tier_io.install(got, load.block_ids)
            self.scheduler.finish_loading(req, got.sources if got is not None else [])
        self.pending = still

    def close(self) -> None:
        self.io.shutdown(wait=True)
        self.tier_io.close()
