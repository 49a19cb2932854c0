"""Moves block bytes between the device pool and the tiers below it, off the step's path."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from kvos.cache.block import BlockHash, KVBlock
from kvos.cache.block_pool import BlockPool
from kvos.cache.tiers import (
    CPUTier,
    DiskTier,
    RedisTier,
    TierHierarchy,
    TransferTier,
    allocate_bytearray,
)
from kvos.cache.tiers.codec import sealed_codec_from_file
from kvos.connector.tier_io import LoadedBlocks, TierIO, host_digest
from kvos.core.request import Request, RequestStatus
from kvos.scheduler.scheduler import PrefixLoad, Scheduler

GIB = 1 << 30


def build_hierarchy(cpu_cache_gb: float, disk_cache_dir: str | None, disk_cache_gb: float,
                    remote_cache: str | None, write_policy: str, pinned: bool = False,
                    encryption_key_file: str | None = None, transfer_gb: float = 0.0,
                    device_verify: bool = False) -> TierHierarchy | None:
    """The configured tiers; ``pinned``: the CPU tier's slots are page-locked memory (the engine
    runs on a GPU); ``device_verify``: the CPU tier keeps digest frames, checked on the device
    after a load's copy (``TierIO``); ``encryption_key_file``
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
        tiers.append(CPUTier(int(cpu_cache_gb * GIB), allocate, digest_fn=host_digest if device_verify else None))
    codec = sealed_codec_from_file(encryption_key_file if disk_cache_dir or remote_cache else None)
    if disk_cache_dir:
        tiers.append(DiskTier(disk_cache_dir, int(disk_cache_gb * GIB), codec))
    if remote_cache:
        tiers.append(RedisTier(remote_cache, codec=codec))
    return TierHierarchy(tiers, write_policy) if tiers else None


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
    (write-through, all of the step's blocks in one batch) or inside the pool's eviction
    callback, before the block's new owner writes it (write-back); loaded bytes are written only
    into blocks of a request still LOADING.

    Lookups (``lookup``, the scheduler's ``lower_tier_lookup``) never touch a tier on the engine
    thread: each is one batched ``TierHierarchy.lookup`` on the I/O thread (behind the stores
    submitted before it, so it sees them), whose answer is remembered per waiting request. A
    remembered answer may be stale by the time the request is admitted (a tier evicted a block
    meanwhile); that is safe because ``fetch`` stops at the first block it cannot find and
    ``finish_loading`` counts only what was loaded: the rest of the prompt is recomputed.
    """

    def __init__(self, hierarchy: TierHierarchy, runner, pool: BlockPool, scheduler: Scheduler,
                 lookahead: int = 0) -> None:
        self.h = hierarchy
        self.lookahead = lookahead
        self.cpu = next((t for t in hierarchy.tiers if isinstance(t, CPUTier) and t.receives_stores), None)
        self.transfer = next((t for t in hierarchy.tiers if isinstance(t, TransferTier)), None)
        self._demand_of: tuple[str, ...] = ()  # the waiting head the CPU tier's demand was built from
        self.runner = runner
        self.pool = pool
        self.scheduler = scheduler
        self.tier_io = TierIO(hierarchy, runner)
        if self.cpu is not None and runner.device.type == "cuda":  # pin every slot up front, not mid-run
            self.cpu.preallocate(runner.block_bytes, background=True)
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvos-tier-io")
        self.pending: list[tuple[PrefixLoad, Future[LoadedBlocks]]] = []
        self.storing: list[tuple[Future[None], list[KVBlock]]] = []
        """Write-through batches in flight, oldest first, with the blocks each holds."""
        self.lookups: dict[str, _Lookup] = {}
        """Per waiting request id: its latest lookup (answered or not). Entries of requests no
        longer waiting are dropped at the start of each step (``install_ready``)."""
        scheduler.lower_tier_lookup = self.lookup
        if not any(t.receives_stores for t in hierarchy.tiers):
            pass  # only transferred blocks: nothing of this engine's is stored
        elif hierarchy.write_policy == "write_through":
            pool.newly_cached = []
        else:
            pool.on_evict = self._on_evict

    MAX_STORE_BACKLOG = 2
    """Write-through batches in flight at most: with that many in flight, a step's batch waits
    for the oldest (a tier slower than the engine slows it rather than losing blocks or
    holding device blocks without bound)."""

    def _store(self, blocks: list[KVBlock], evicted: bool) -> None:
        """Write-back (``evicted``, inside the pool's eviction callback): read now, the block is
        about to be rewritten. Write-through: handed to the I/O thread (``store_computed``) with
        a reference held on each block until it is done, so the engine thread never waits."""
        ids, hashes = [b.block_id for b in blocks], [b.block_hash for b in blocks]
        if evicted:
            digests: list[int] | None = [] if self.tier_io.digests else None
            rows = self.runner.read_blocks(ids, digests)
            self.io.submit(self.tier_io.store, hashes, rows, evicted, digests)
            return
        self.release_stored()
        while len(self.storing) >= self.MAX_STORE_BACKLOG:
            self.storing[0][0].exception()  # waits
            self.release_stored()
        after = None
        if self.runner.device.type == "cuda":
            after = torch.cuda.Event()
            after.record()
        self.pool.touch(blocks)
        self.storing.append((self.io.submit(self.tier_io.store_computed, hashes, ids, after), blocks))

    def release_stored(self, wait: bool = False) -> None:
        """Engine thread: drop the references of write-through batches that are done (with
        ``wait``: of all, waiting for them). A failed batch only loses its stores."""
        while self.storing and (wait or self.storing[0][0].done()):
            fut, blocks = self.storing.pop(0)
            try:
                fut.result()
            except Exception:  # the tier I/O failed: nothing was stored, the engine goes on
                pass
            self.pool.free_blocks(reversed(blocks))

    def _on_evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        self._store([block], True)

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
            demand.update(zip(kv.block_hashes(req)[:n], zip([rank] * n, range(n))))
        self.cpu.set_demand(demand)

    def after_step(self) -> None:
        """Publish the waiting queue's demand, then (write-through) back up every block
        registered this step; give back the blocks of finished reads (all of them, waiting,
        once no request is left, so an idle engine holds no block)."""
        self.publish_demand()
        if self.pool.newly_cached:
            blocks = [b for b in self.pool.newly_cached if b.block_hash is not None]
            self.pool.newly_cached.clear()
            if blocks:
                self._store(blocks, False)
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
        self.lookups[request.request_id] = _Lookup(request, asked, self.io.submit(self.h.lookup, asked))
        return None

    def _forget_settled(self) -> None:
        """Drop remembered lookups of requests that left the waiting state (admitted, finished,
        aborted): a request waiting again later (preempted) asks anew."""
        if not self.lookups:
            return  # (every step calls this: nothing to scan without a tier lookup in flight)
        requests = self.scheduler.requests
        self.lookups = {rid: e for rid, e in self.lookups.items()
                        if e.request.status == RequestStatus.WAITING and requests.get(rid) is e.request}

    def dispatch(self, loads: list[PrefixLoad]) -> None:
        for load in loads:
            self.pending.append((load, self.io.submit(self.tier_io.fetch, load.hashes)))

    def install_ready(self, block: bool = False) -> None:
        """Install finished loads and forget lookups of requests no longer waiting. With
        ``block`` (nothing can run until tier I/O answers), first wait until at least one load
        or lookup finishes; it returns at once when none is pending, and each one ends within
        the tiers' own timeouts. A finished fetch's copies are complete (``TierIO.fetch``), so
        installing never waits for a transfer."""
        self._forget_settled()
        if block:
            waiting = [f for _, f in self.pending] + [e.answer for e in self.lookups.values()
                                                      if not e.answer.done()]
            if waiting:
                wait(waiting, return_when=FIRST_COMPLETED)
        if not self.pending:
            return
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
