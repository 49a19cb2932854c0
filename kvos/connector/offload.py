"""Moves block bytes between the device pool and the tiers below it, off the step's path."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from kvos.cache.block import BlockHash, KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.kv_manager import KVCacheManager
from kvos.cache.tiers import (
    CPUTier,
    DiskTier,
    RedisTier,
    TierHierarchy,
    TransferTier,
    allocate_bytearray,
    group_key,
    group_tags,
)
from kvos.cache.tiers.codec import sealed_codec_from_file
from kvos.connector.tier_io import LoadedBlocks, TierIO, host_digest
from kvos.core.request import Request, RequestStatus
from kvos.scheduler.scheduler import PrefixLoad, Scheduler

GIB = 1 << 30


def build_hierarchy(cpu_cache_gb: float, disk_cache_dir: str | None, disk_cache_gb: float,
                    remote_cache: str | None, write_policy: str, pinned: bool = False,
                    encryption_key_file: str | None = None, transfer_gb: float = 0.0,
                    device_verify: bool = False, eviction_policy: str = "lru") -> TierHierarchy | None:
    """The configured tiers; ``pinned``: the CPU tier's slots are page-locked memory (the engine
    runs on a GPU); ``device_verify``: the CPU tier keeps digest frames, checked on the device
    after a load's copy (``TierIO``); ``eviction_policy`` (``EngineConfig.tier_eviction_policy``):
    the CPU tier's; ``encryption_key_file``
    (``EngineConfig.tier_encryption_key_file``): the disk and Redis tiers seal their blocks with
    AES-256-GCM under that key (the CPU tier, process memory, keeps keyed-checksum frames)."""
    tiers: list = []
    if cpu_cache_gb < 0 or disk_cache_gb <= 0 or transfer_gb < 0:
        raise ValueError("cpu_cache_gb and kv_transfer_gb must be >= 0 and disk_cache_gb > 0")
    if transfer_gb:  # first: a transferred prefix is the freshest copy there is
        tiers.append(TransferTier(int(transfer_gb * GIB)))
    if cpu_cache_gb:
        if pinned:
            from kvos.connector.host_memory import PageLockedAllocator

            allocate = PageLockedAllocator()
        else:
            allocate = allocate_bytearray
        tiers.append(CPUTier(int(cpu_cache_gb * GIB), allocate, digest_fn=host_digest if device_verify else None,
                             eviction_policy=eviction_policy))
    codec = sealed_codec_from_file(encryption_key_file if disk_cache_dir or remote_cache else None)
    if disk_cache_dir:
        tiers.append(DiskTier(disk_cache_dir, int(disk_cache_gb * GIB), codec))
    if remote_cache:
        tiers.append(RedisTier(remote_cache, codec=codec))
    return TierHierarchy(tiers, write_policy) if tiers else None


@dataclass
class _GroupLoad:
    """One cache group's part of a ``PrefixLoad``: ``keys`` (tier keys) into ``block_ids``, the
    first of them the load's block ``first`` (counted after the device hit)."""

    group: int
    first: int
    block_ids: list[int]
    keys: list[BlockHash]


@dataclass
class _Lookup:
    """One batched tier lookup asked for ``request`` (a waiting request) about ``hashes``."""

    request: Request
    hashes: list[BlockHash]
    answer: Future[int]

    def offset(self, hashes: list[BlockHash]) -> int | None:
        """Where ``hashes`` (non-empty) starts in ``self.hashes``, if it is a run of them that
        ends no later (the device hit grew meanwhile); else None. Block hashes are chained, so
        a block's hash fixes its position."""
        try:
            k = self.hashes.index(hashes[0])
        except ValueError:
            return None
        return k if self.hashes[k: k + len(hashes)] == hashes else None

    def known(self, hashes: list[BlockHash]) -> int | None:
        """How many leading ``hashes`` the tiers hold, as this finished lookup tells, or None
        when it cannot: ``hashes`` must start at most the answer's count into ``self.hashes``
        (the blocks it skips were all held below, the answer's end is still a miss)."""
        if not hashes:
            return 0
        k, n = self.offset(hashes), self.count()
        return None if k is None or k > n else min(n - k, len(hashes))

    def count(self) -> int:
        """The finished lookup's answer; a failed lookup counts as no blocks below."""
        try:
            return self.answer.result(timeout=0)
        except Exception:  # a failed lookup: as if nothing were below (the prompt is computed)
            return 0


class OffloadManager:
    """The scheduler side of the KV connector (``kvos.scheduler.connector``); ``TierIO`` is its
    worker side.

    Device-side reads and writes happen on the engine thread (block bytes are only valid
    while the pool says so); tier I/O happens on one background thread (``TierIO`` explains why
    there must be exactly one).

    Safety rules: a computed block's bytes are read right after the step that registered it
    (write-through, all of the step's blocks in one batch per cache group) or inside the pool's
    eviction notice (``block_evicting``), before the block's new owner writes it (write-back);
    loaded bytes are written only into blocks of a request still LOADING.

    Cache groups (hybrid layouts): every group's blocks are stored, each under its tier key
    (``kvos.cache.tiers.keys``: the chained hash bound to the group). A prefix counts as below
    the device only as far as every group can restore it, by the device prefix cache's own
    rule (``KVCacheManager.restorable_blocks``: full-attention groups need every block,
    sliding-window groups only the window's at the prefix's end), and a load fetches just
    those blocks; a sliding group's blocks behind that window are freed unloaded before the
    request is handed back (``KVCacheManager.drop_unneeded``), so no garbage is ever cached.

    Lookups (``lookup``, the scheduler's ``lower_tier_lookup``) never touch a tier on the engine
    thread: each is one batched ``TierHierarchy.lookup`` on the I/O thread (behind the stores
    submitted before it, so it sees them), whose answer is remembered per waiting request. A
    remembered answer may be stale by the time the request is admitted (a tier evicted a block
    meanwhile); that is safe because ``fetch`` stops at the first block it cannot find and
    ``finish_loading`` counts only what was loaded: the rest of the prompt is recomputed.
    """

    def __init__(self, hierarchy: TierHierarchy, runner, kv: KVCacheManager, scheduler: Scheduler,
                 lookahead: int = 0) -> None:
        self.h = hierarchy
        self.lookahead = lookahead
        self.cpu = next((t for t in hierarchy.tiers if isinstance(t, CPUTier) and t.receives_stores), None)
        self.transfer = next((t for t in hierarchy.tiers if isinstance(t, TransferTier)), None)
        self._demand_of: tuple[str, ...] = ()  # the waiting head the CPU tier's demand was built from
        self.runner = runner
        self.kv = kv
        self.tags = group_tags(kv.layout)
        """Per cache group, what its tier keys bind (``group_key``)."""
        self.hybrid = kv.num_groups > 1
        self.scheduler = scheduler
        self.tier_io = TierIO(hierarchy, runner)
        if self.cpu is not None:  # slots fit every group's blocks (the first store would size them for its own)
            largest = max(runner.group_block_bytes(g) for g in range(kv.num_groups))
            if runner.device.type == "cuda":  # pin every slot up front, not mid-run
                self.cpu.preallocate(largest, background=True)
            else:
                self.cpu.size_slots(largest)
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvos-tier-io")
        self.pending: list[tuple[PrefixLoad, list[_GroupLoad], Future[list[LoadedBlocks]]]] = []
        self.storing: list[tuple[Future[None], BlockPool, list[KVBlock]]] = []
        """Write-through batches in flight, oldest first, with the blocks each holds."""
        self.lookups: dict[str, _Lookup] = {}
        """Per waiting request id: its latest lookup (answered or not). Entries of requests no
        longer waiting are dropped at the start of each step (``install_ready``)."""
        scheduler.lower_tier_lookup = self.lookup
        stores = any(t.receives_stores for t in hierarchy.tiers)  # else only transferred blocks
        self._write_through = stores and hierarchy.write_policy == "write_through"
        self._write_back = stores and not self._write_through
        self._computed: list[tuple[int, KVBlock]] = []
        """(group, block) registered since the last step's write-through, in order."""
        if stores:  # one explicit call: the manager (and its pools) exist before the scheduler this needs
            kv.add_listener(self)

    def key(self, group: int, block_hash: BlockHash) -> BlockHash:
        """The tier key of cache group ``group``'s block of ``block_hash``."""
        return group_key(block_hash, self.tags[group])

    # -- BlockPoolListener ---------------------------------------------------------------
    def block_cached(self, group: int, block: KVBlock, adopted: bool) -> None:
        if self._write_through and not adopted:  # adopted: loaded from a tier or another engine, stored there
            self._computed.append((group, block))

    def block_evicting(self, group: int, block: KVBlock) -> None:
        if self._write_back:
            assert block.block_hash is not None
            self._store(group, [block], True)

    MAX_STORE_BACKLOG = 2
    """Write-through batches in flight at most: with that many in flight, a step's batch waits
    for the oldest (a tier slower than the engine slows it rather than losing blocks or
    holding device blocks without bound)."""

    def _store(self, group: int, blocks: list[KVBlock], evicted: bool) -> None:
        """Write-back (``evicted``, inside the pool's eviction callback): read now, the block is
        about to be rewritten. Write-through: handed to the I/O thread (``store_computed``) with
        a reference held on each block until it is done, so the engine thread never waits."""
        ids, hashes = [b.block_id for b in blocks], [self.key(group, b.block_hash) for b in blocks]
        parents = [None if b.parent_hash is None else self.key(group, b.parent_hash) for b in blocks]
        if evicted:
            digests: list[int] | None = [] if self.tier_io.digests else None
            rows = self.runner.read_blocks(ids, digests, group=group)
            self.io.submit(self.tier_io.store, hashes, rows, evicted, digests, parents)
            return
        self.release_stored()
        while len(self.storing) >= self.MAX_STORE_BACKLOG:
            self.storing[0][0].exception()  # waits
            self.release_stored()
        after = None
        if self.runner.device.type == "cuda":
            after = torch.cuda.Event()
            after.record()
        pool = self.kv.pools[group]
        pool.touch(blocks)
        self.storing.append((self.io.submit(self.tier_io.store_computed, hashes, ids, after, group, parents),
                             pool, blocks))

    def release_stored(self, wait: bool = False) -> None:
        """Engine thread: drop the references of write-through batches that are done (with
        ``wait``: of all, waiting for them). A failed batch only loses its stores."""
        while self.storing and (wait or self.storing[0][0].done()):
            fut, pool, blocks = self.storing.pop(0)
            try:
                fut.result()
            except Exception:  # the tier I/O failed: nothing was stored, the engine goes on
                pass
            pool.free_blocks(reversed(blocks))

    def publish_demand(self) -> None:
        """Tell the CPU tier which blocks the next ``lookahead`` waiting requests will hit
        (``SlotArena``: evicted last, farthest in the queue first). Rebuilt only when the
        waiting head changed and the tier's free slots could run out within a step (a step
        stores at most one block per scheduled token and evicts at most as many): about
        3 ms for 1,024 waiting requests of 30 blocks."""
        free = None if self.cpu is None or not self.lookahead else self.cpu.free_slots()
        cfg, kv = self.scheduler.config, self.scheduler.kv
        bs = kv.block_size
        if free is None or free > 2 * (cfg.max_num_batched_tokens // bs + cfg.max_num_seqs):
            return
        head = self.scheduler.waiting_head(self.lookahead)
        ids = tuple(r.request_id for r in head)
        if ids == self._demand_of:
            return
        self._demand_of = ids
        demand: dict[BlockHash, tuple[int, int]] = {}
        for rank in range(len(head) - 1, -1, -1):  # an earlier request's claim overwrites a later one's
            req = head[rank]
            n = (req.num_tokens - 1) // bs  # blocks it could hit (its last prompt token is always computed)
            for g in range(kv.num_groups):
                demand.update(zip([self.key(g, h) for h in kv.block_hashes(req)[:n]], zip([rank] * n, range(n))))
        self.cpu.set_demand(demand)

    def after_step(self) -> None:
        """Publish the waiting queue's demand, then (write-through) back up every block
        registered this step; give back the blocks of finished reads (all of them, waiting,
        once no request is left, so an idle engine holds no block)."""
        self.publish_demand()
        if self._computed:
            computed, self._computed = self._computed, []
            for g in range(self.kv.num_groups):
                blocks = [b for group, b in computed if group == g and b.block_hash is not None]
                if blocks:
                    self._store(g, blocks, False)
        self.release_stored(wait=not self.scheduler.has_unfinished())

    def lookup(self, request: Request, hashes: list[BlockHash]) -> int | None:
        """Engine thread, never blocks: how many leading ``hashes`` (``request``'s block hashes
        after its device hit) the tiers hold, or None while not known yet. The first ask for a
        request (or an ask its remembered lookup cannot answer: other hashes) submits one
        batched lookup to the I/O thread; later asks get the remembered answer."""
        entry = self.lookups.get(request.request_id)
        if entry is not None and entry.request is request and hashes:
            if not entry.answer.done():
                if entry.offset(hashes) is not None:
                    return None  # asked already: the answer will tell
            else:
                known = entry.known(hashes)
                if known is not None:
                    return known
        asked = list(hashes)
        self.lookups[request.request_id] = _Lookup(request, asked, self.io.submit(self._count_below, asked))
        return None

    def _count_below(self, hashes: list[BlockHash]) -> int:
        """I/O thread: how many leading ``hashes`` (after the device hit) every group can restore
        from the tiers. One group: the leading keys held. Several: each group's keys held, then
        the prefix cache's rule (``restorable_blocks``; pure, reads no manager state)."""
        if not self.hybrid:
            return self.h.lookup(hashes)
        held = [self.h.held([group_key(h, tag) for h in hashes]) for tag in self.tags]
        return self.kv.restorable_blocks([got.__getitem__ for got in held], len(hashes))

    def _forget_settled(self) -> None:
        """Drop remembered lookups of requests that left the waiting state (admitted, finished,
        aborted): a request waiting again later (preempted) asks anew."""
        if not self.lookups:
            return  # (every step calls this: nothing to scan without a tier lookup in flight)
        requests = self.scheduler.requests
        self.lookups = {rid: e for rid, e in self.lookups.items()
                        if e.request.status == RequestStatus.WAITING and requests.get(rid) is e.request}

    def dispatch(self, loads: list[PrefixLoad]) -> None:
        """Start each load: per cache group, the blocks a hit of the load's length needs
        (``KVCacheManager.needed_blocks``), into the request's blocks at those positions."""
        for load in loads:
            if not self.hybrid:
                parts = [_GroupLoad(0, 0, load.block_ids, load.hashes)]
            else:
                start = load.request.num_computed_tokens // self.kv.block_size  # its device hit
                tables = self.kv.block_tables(load.request.request_id)
                parts = [_GroupLoad(g, need.start, [b.block_id for b in tables[g][start + need.start: start + need.stop]],
                                    [self.key(g, h) for h in load.hashes[need.start: need.stop]])
                         for g, need in enumerate(self.kv.needed_blocks(len(load.hashes)))]
            self.pending.append((load, parts, self.io.submit(self._fetch, parts)))

    def _fetch(self, parts: list[_GroupLoad]) -> list[LoadedBlocks]:
        """I/O thread: each group's part of a load, one after the other."""
        return [self.tier_io.fetch(p.keys, p.group if self.hybrid else None) for p in parts]

    def _install(self, load: PrefixLoad, parts: list[_GroupLoad], got: list[LoadedBlocks]) -> list[str]:
        """Engine thread: write what arrived of each group and return the sources of the blocks
        the request may count computed: the longest prefix every group restored (the prefix
        cache's rule); a sliding group's blocks behind that prefix's window are freed unloaded."""
        if not self.hybrid:
            self.tier_io.install(got[0], parts[0].block_ids)
            return got[0].sources
        held = [range(p.first, p.first + len(g.sources)).__contains__ for p, g in zip(parts, got)]
        n = self.kv.restorable_blocks(held, len(load.hashes))
        sources: list[str | None] = [None] * n
        for p, g in zip(parts, got):
            keep = max(0, min(len(g.sources), n - p.first))
            self.tier_io.install(LoadedBlocks(g.sources[:keep], g.rows[:keep], g.ready), p.block_ids, p.group)
            for i, src in enumerate(g.sources[:keep]):
                sources[p.first + i] = sources[p.first + i] or src
        start = load.request.num_computed_tokens // self.kv.block_size
        for g, need in enumerate(self.kv.needed_blocks(n)):
            if need.start:  # a sliding group: the blocks behind the window were not loaded
                self.kv.drop_unneeded(load.request.request_id, g, range(start, start + need.start))
        first = next((s for s in sources if s is not None), "")
        return [s or first for s in sources]

    def install_ready(self, block: bool = False) -> None:
        """Install finished loads and forget lookups of requests no longer waiting. With
        ``block`` (nothing can run until tier I/O answers), first wait until at least one load
        or lookup finishes; it returns at once when none is pending, and each one ends within
        the tiers' own timeouts. A finished fetch's copies are complete (``TierIO.fetch``), so
        installing never waits for a transfer."""
        self._forget_settled()
        if block:
            waiting = [f for _, _, f in self.pending] + [e.answer for e in self.lookups.values()
                                                      if not e.answer.done()]
            if waiting:
                wait(waiting, return_when=FIRST_COMPLETED)
        if not self.pending:
            return
        still = []
        for load, parts, fut in self.pending:
            if not fut.done():
                still.append((load, parts, fut))
                continue
            try:
                got = fut.result()
            except Exception:  # e.g. no device memory for the staging rows: recompute
                got = None
            req = load.request
            if req.request_id not in self.scheduler.loading:
                continue  # aborted while loading: its blocks may belong to someone else now
            self.scheduler.finish_loading(req, self._install(load, parts, got) if got is not None else [])
        self.pending = still

    def receive(self, hashes: list[BlockHash], rows) -> int:
        """Put blocks another engine computed (``rows``: uint8 ``[n, block_bytes]``, from its
        ``read_blocks``) into the transfer tier, on the tier I/O thread (the only thread that puts);
        returns how many were stored. Any thread; blocks until done."""
        if self.transfer is None:
            raise RuntimeError("this engine has no transfer tier (kv_transfer_gb is 0)")
        tier = self.transfer

        def put() -> int:
            return sum(tier.put(h, rows[i].data) for i, h in enumerate(hashes))

        return self.io.submit(put).result()

    def close(self) -> None:
        self.io.shutdown(wait=True)
        self.tier_io.close()
