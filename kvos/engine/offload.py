"""Moves block bytes between the device pool and the tiers below it, off the step's path."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait, FIRST_COMPLETED

from kvos.cache.block import KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.tiers import CPUTier, DiskTier, RedisTier, TierHierarchy
from kvos.engine.scheduler import PrefixLoad, Scheduler

GIB = 1 << 30


def build_hierarchy(cpu_cache_gb: float, disk_cache_dir: str | None, disk_cache_gb: float,
                    remote_cache: str | None, write_policy: str) -> TierHierarchy | None:
    tiers = []
    if cpu_cache_gb < 0 or disk_cache_gb <= 0:
        raise ValueError("cpu_cache_gb must be >= 0 and disk_cache_gb > 0")
    if cpu_cache_gb:
        tiers.append(CPUTier(int(cpu_cache_gb * GIB)))
    if disk_cache_dir:
        tiers.append(DiskTier(disk_cache_dir, int(disk_cache_gb * GIB)))
    if remote_cache:
        tiers.append(RedisTier(remote_cache))
    return TierHierarchy(tiers, write_policy) if tiers else None


class OffloadManager:
    """Copies happen on the engine thread (block bytes are only valid while the pool says so);
    tier I/O happens on one background thread.

    Safety rules: a computed block's bytes are read right after the step that registered it
    (write-through) or inside the pool's eviction callback, before the block's new owner writes
    it (write-back); loaded bytes are written only into blocks of a request still LOADING.
    """

    def __init__(self, hierarchy: TierHierarchy, runner, pool: BlockPool, scheduler: Scheduler) -> None:
        self.h = hierarchy
        self.runner = runner
        self.pool = pool
        self.scheduler = scheduler
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvos-tier-io")
        self.pending: list[tuple[PrefixLoad, Future]] = []
        scheduler.lower_tier_lookup = hierarchy.lookup
        if hierarchy.write_policy == "write_through":
            pool.newly_cached = []
        else:
            pool.on_evict = self._on_evict

    def _on_evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        self.io.submit(self.h.store, block.block_hash, self.runner.read_block(block.block_id), True)

    def after_step(self) -> None:
        """Write-through: back up every block registered this step."""
        if self.pool.newly_cached:
            for block in self.pool.newly_cached:
                if block.block_hash is not None:
                    self.io.submit(self.h.store, block.block_hash, self.runner.read_block(block.block_id), False)
            self.pool.newly_cached.clear()

    def dispatch(self, loads: list[PrefixLoad]) -> None:
        for load in loads:
            self.pending.append((load, self.io.submit(self._fetch, load.hashes)))

    def _fetch(self, hashes: list[bytes]) -> list[tuple[bytes, str]]:
        out = []
        for h in hashes:
            got = self.h.load(h)
            if got is None:  # missing or failed its checksum: the rest is recomputed
                break
            out.append(got)
        return out

    def install_ready(self, block: bool = False) -> None:
        """Install finished loads (waiting for at least one if ``block``)."""
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
            except Exception:
                got = []
            req = load.request
            if req.request_id not in self.scheduler.loading:
                continue  # aborted while loading: its blocks may belong to someone else now
            for (data, _), block_id in zip(got, load.block_ids):
                self.runner.write_block(block_id, data)
            self.scheduler.finish_loading(req, [src for _, src in got])
        self.pending = still

    def close(self) -> None:
        self.io.shutdown(wait=True)
