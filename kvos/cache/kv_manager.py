"""The scheduler's one handle on KV memory: hits, allocation, forks and frees, over every cache
group of one pool."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from kvos.cache.block import BlockHash, KVBlock
from kvos.cache.block_pool import BlockPool, LogicalClock
from kvos.cache.encoder_pages import EncoderPages
from kvos.cache.events import KVEventLog
from kvos.cache.eviction import EvictionPolicy, HitProtectedLRUPolicy, make_policy
from kvos.cache.full_attention import FullAttentionManager
from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.cache.layout import CacheLayout, single_group_layout
from kvos.cache.listener import BlockPoolListener, EventLogListener
from kvos.cache.mamba_state import MambaStateManager
from kvos.cache.page_pool import LargePagePool
from kvos.cache.sequence import CacheableSequence
from kvos.cache.sliding_window import SlidingWindowManager
from kvos.cache.spec import KVCacheSpec
from kvos.cache.stats import CacheCounters, CacheUsage
from kvos.core.kv_events import KVSnapshot

MANAGERS: dict[str, type[FullAttentionManager]] = {
    "full_attention": FullAttentionManager, "sliding_window": SlidingWindowManager,
    "mamba_state": MambaStateManager}
"""The per-group manager for each kind of cache spec."""

ComputedBlocks = list[list[KVBlock]]
"""A prefix hit: for each group, its blocks (null placeholders where the group needs none)."""


class KVCacheManager:
    """Coordinates one ``LargePagePool`` of ``num_blocks`` pages (page 0 holds the null blocks),
    a ``BlockPool`` and a manager per cache group. With one group of one block per page (every
    non-hybrid model) a page is a block.

    Contract with the scheduler:
    - ``get_computed_blocks`` before a sequence's first allocation (or after preemption); it
      never covers the last known token, whose logits must be computed.
    - ``allocate_slots`` is all-or-nothing for references: on False no block was referenced or
      released for the sequence (cached content may have been evicted) and the caller may
      preempt and retry.
    - ``cache_blocks`` after each step that computed tokens of the sequence (never before).
    - ``free`` once per sequence that was allocated; afterwards no block is referenced by it.
    - ``take_copies`` returns the copy-on-write copies (group, src, dst) the runner must do
      before this step's forward.
    """

    def __init__(self, layout: CacheLayout | KVCacheSpec, num_blocks: int, model_id: str = "",
                 enable_caching: bool = True, policy: EvictionPolicy | str | None = None,
                 next_use=None, page_quota: dict[int, int] | None = None) -> None:
        if isinstance(layout, KVCacheSpec):
            layout = single_group_layout(layout)
        self.layout = layout
        self.model_id = model_id
        self.counters = CacheCounters()
        self.pages = LargePagePool(num_blocks, page_quota)  # page_quota: a fixed split (comparisons only)
        clock = self.clock = LogicalClock()
        if isinstance(policy, EvictionPolicy) and len(layout.groups) > 1:
            raise ValueError("a policy instance serves one group; pass the policy's name for several groups")
        self.pools: list[BlockPool] = []
        self.managers: list[FullAttentionManager] = []
        for g, group in enumerate(layout.groups):
            sliding = group.spec.kind in ("sliding_window", "mamba_state")  # no chain order
            if isinstance(policy, EvictionPolicy):
                pol = policy
            elif sliding and (policy or "lru") == "lru":
                pol = HitProtectedLRUPolicy()  # keep the windows that end shared prefixes
            else:
                pol = make_policy(policy or "lru", next_use, capacity=num_blocks * layout.blocks_per_large_page(g),
                                  block_size=layout.block_size)
            pool = BlockPool(enable_caching=enable_caching, counters=self.counters, policy=pol, pages=self.pages,
                             per_page=layout.blocks_per_large_page(g), group=g, clock=clock,
                             chain_order=not sliding, owner=self)
            self.pools.append(pool)
            self.managers.append(MANAGERS[group.spec.kind](group.spec, pool))
        self._sliding = [m for m in self.managers if isinstance(m, SlidingWindowManager)]
        self.demand: Callable[[], Iterable[CacheableSequence]] | None = None
        """Set by the scheduler for one step: the waiting sequences, in queue order, whose cached
        prefixes are evicted last, farthest in the queue first (vLLM RFC #48485's idea, with the
        queue position as a known next use). Read lazily, at the step's first eviction."""
        self._demand_held = False
        self._hashes: dict[str, list[BlockHash]] = {}
        self._roots: dict[str, BlockHash] = {}
        self._tokens: dict[str, int] = {}
        self._cached_full: dict[str, int] = {}  # full blocks cache_blocks has registered, per sequence
        self._borrowed: dict[str, list[ComputedBlocks]] = {}  # cached blocks a sequence reads, not owns
        self._events: KVEventLog | None = None
        self._event_listener: EventLogListener | None = None
        self.encoder: EncoderPages | None = None
        """Image encodings in pages of this pool (``attach_encoder``), else None."""

    # -- queries -------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def enable_caching(self) -> bool:
        return self.pools[0].enable_caching

    @property
    def pool(self) -> BlockPool:
        """The only group's pool, for callers that handle one group (the simulator's abstract
        model, block adoption of another engine's rows); hybrid layouts use ``pools``."""
        if len(self.pools) != 1:
            raise ValueError(f"this caller handles one cache group; this layout has {len(self.pools)} "
                             "(use kv.pools)")
        return self.pools[0]

    def add_listener(self, listener: BlockPoolListener) -> None:
        """Let ``listener`` hear every group's registrations and evictions from now on."""
        for pool in self.pools:
            pool.add_listener(listener)

    def pages_for_tokens(self, num_tokens: int, chunk: int | None = None) -> int:
        """Large pages one sequence of ``num_tokens`` tokens needs at its peak, prefilled in
        chunks of ``chunk`` tokens (default: all at once): every block in full-attention groups,
        in sliding groups the window's blocks plus one chunk's."""
        bs, chunk = self.block_size, chunk or num_tokens
        pages = 0
        for g, m in enumerate(self.managers):
            blocks = -(-num_tokens // bs)
            if isinstance(m, MambaStateManager):
                blocks = m.peak_blocks(num_tokens, chunk)
            elif isinstance(m, SlidingWindowManager):
                blocks = min(blocks, -(-(m.window - 1 + chunk) // bs) + 1)
            pages += -(-blocks // self.layout.blocks_per_large_page(g))
        return pages

    def capacity_tokens(self, chunk: int | None = None) -> int:
        """The longest sequence the whole pool can hold (prefilled in chunks of ``chunk``)."""
        usable = self.pages.num_usable
        if self.pages_for_tokens(1 << 40, chunk) <= usable:
            return 1 << 40  # every group slides: any length fits
        lo, hi = 0, usable * max(p.per_page for p in self.pools) * self.block_size
        while lo < hi:  # pages_for_tokens grows with the length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.pages_for_tokens(mid, chunk) <= usable else (lo, mid - 1)
        return lo

    def root(self, seq: CacheableSequence) -> BlockHash:
        r = self._roots.get(seq.request_id)
        if r is None:
            r = self._roots[seq.request_id] = root_hash(self.model_id, seq.cache_salt)
        return r

    def block_hashes(self, seq: CacheableSequence) -> list[BlockHash]:
        """Chained hashes of every full block of ``seq``'s known tokens (computed lazily; the
        same for every group)."""
        hashes = self._hashes.setdefault(seq.request_id, [])
        extend_block_hashes(hashes, seq.all_token_ids, self.block_size, self.root(seq), getattr(seq, "media", ()))
        return hashes

    def _registrable_hashes(self, seq: CacheableSequence) -> list[BlockHash]:
        """``block_hashes`` cut before the first block holding approximate KV
        (``exact_tokens``): what ``cache_blocks`` and sliding releases may register."""
        hashes = self.block_hashes(seq)
        exact = getattr(seq, "exact_tokens", None)
        return hashes if exact is None else hashes[: exact // self.block_size]

    # -- prefix hits ---------------------------------------------------------------------
    def get_computed_blocks(self, seq: CacheableSequence) -> tuple[ComputedBlocks, int]:
        """Longest cached prefix of ``seq`` that every group can serve: (blocks per group,
        tokens covered). The caller records the query with ``record_prefix_query`` once the
        sequence is actually admitted.

        A fixed point over groups: start from every full block but the last token's, ask each
        group for its longest hit at most that long, shrink to its answer and start over until
        all groups agree. Correct because each group returns the *longest* length it can serve
        that is at most the bound it was given: the longest length L* that all groups can serve
        is at most every answer, so the bound never drops below L*, and when all agree the
        bound is a length all can serve, hence L*. It terminates because the bound only
        shrinks. Full attention is downward closed, so after the first pass it always agrees.
        """
        if not self.enable_caching:
            return [[] for _ in self.managers], 0
        hits = self.prefix_blocks(self.block_hashes(seq), (seq.num_tokens - 1) // self.block_size)
        return hits, len(hits[0]) * self.block_size

    def prefix_blocks(self, hashes: list[BlockHash], max_blocks: int) -> ComputedBlocks:
        """The longest cached prefix of at most ``max_blocks`` of ``hashes`` that every group can
        serve, as blocks per group (null placeholders where a group needs none; every group's
        list has the prefix's length). The fixed point ``get_computed_blocks`` describes; no
        side effects (nothing is referenced)."""
        bound = max_blocks
        while True:
            hits: ComputedBlocks = []
            for m in self.managers:
                hit = m.find_longest_hit(hashes, bound)
                if len(hit) < bound:
                    bound = len(hit)
                    break
                hits.append(hit)
            else:
                return hits

    def longest_hit_tokens(self, seq: CacheableSequence, max_tokens: int) -> int:
        """Tokens of ``seq``'s first ``max_tokens`` that the cache would serve (no side effects)."""
        if not self.enable_caching:
            return 0
        hashes = self.block_hashes(seq)
        bound = max_tokens // self.block_size
        while True:
            got = min(len(m.find_longest_hit(hashes, bound)) for m in self.managers)
            if got == bound:
                return bound * self.block_size
            bound = got

    def restorable_blocks(self, held: list[Callable[[int], bool]], max_blocks: int) -> int:
        """The longest prefix of at most ``max_blocks`` blocks (counted after the device hit)
        that every group can serve when group ``g`` holds block ``i`` iff ``held[g](i)``: the
        device prefix cache's own rule (each manager's ``hit_length``) and fixed point
        (``get_computed_blocks``), for a store below the device."""
        bound = max_blocks
        while True:
            got = min(m.hit_length(h, bound) for m, h in zip(self.managers, held))
            if got == bound:
                return bound
            bound = got

    def needed_blocks(self, length: int) -> list[range]:
        """Per group, the blocks a hit of ``length`` blocks needs (``restorable_blocks``)."""
        return [m.needed_blocks(length) for m in self.managers]

    def drop_unneeded(self, request_id: str, group: int, positions: Iterable[int]) -> None:
        """Free the request's blocks at ``positions`` of sliding group ``group`` that hold no
        KV and that no future token reads (see ``SlidingWindowManager.drop_unneeded``)."""
        self.managers[group].drop_unneeded(request_id, positions)

    def record_prefix_query(self, num_tokens: int, hit_tokens: int) -> None:
        if self.enable_caching:
            self.counters.prefix_queries_tokens += num_tokens
            self.counters.prefix_hits_tokens += hit_tokens

    # -- allocation ----------------------------------------------------------------------
    def allocate_slots(self, seq: CacheableSequence, num_new_tokens: int,
                       new_computed: ComputedBlocks | None = None) -> bool:
        """Make room for ``seq``'s next ``num_new_tokens`` tokens after its computed ones and
        the ``new_computed`` prefix hit (whose tokens the caller adds to
        ``num_computed_tokens`` after this returns True). Sliding groups first release the
        blocks that left the window."""
        hits = new_computed if new_computed is not None else [[] for _ in self.managers]
        num_hit = len(hits[0]) if hits else 0
        total = seq.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        if self._sliding:
            caching = self.enable_caching  # released blocks are registered first when caching
            hashes, root = (self._registrable_hashes(seq), self.root(seq)) if caching else ([], b"")
            for m in self._sliding:
                m.remove_skipped_blocks(seq, hashes, root)
        if not num_hit and all(m.fits(seq, total) for m in self.managers):
            self._tokens[seq.request_id] = total
            return True  # decode fast path: the last block has room and is not shared
        needs = [m.num_new_blocks(seq, total, h) for m, h in zip(self.managers, hits)]
        revived = [sum(1 for b in h if b.ref_cnt == 0 and not b.is_null) for h in hits]
        if len(self.pools) == 1:
            pool = self.pools[0]
            if needs[0] + revived[0] > pool.num_free_blocks() + self._encoder_reclaimable() * pool.per_page:
                return False
        elif sum((n + r) * m.spec.page_bytes for n, r, m in zip(needs, revived, self.managers)) > self.free_bytes():
            return False
        for pool, h in zip(self.pools, hits):
            pool.touch(h, hit=True, priority=seq.priority)
        fresh: list[list[KVBlock]] = []
        try:
            for pool, m, h, n in zip(self.pools, self.managers, hits, needs):
                fresh.append(pool.get_new_blocks(n, near=m.last_block(seq.request_id, h)))
        except ValueError:  # fragmented: the bytes exist but not in pages of the right group
            for pool, blocks in zip(self.pools, fresh):
                pool.release_fresh(blocks)
            for pool, h in zip(self.pools, hits):
                pool.free_blocks(reversed(h))
            return False
        for m, h, f in zip(self.managers, hits, fresh):
            m.install(seq, h, f, total)
        self._tokens[seq.request_id] = total
        return True

    def attach_encoder(self, slot_bytes: int, max_pages: int) -> EncoderPages:
        """Keep image encodings in up to ``max_pages`` of this pool's large pages, cut into slots
        of ``slot_bytes`` (a divisor of the large page), as a group after the KV groups."""
        page = self.layout.large_page_bytes
        if slot_bytes < 1 or page % slot_bytes:
            raise ValueError(f"encoder slots of {slot_bytes} B must divide the {page} B pages")
        self.encoder = EncoderPages(self.pages, len(self.pools), slot_bytes, page // slot_bytes, self.clock,
                                    max_pages, reclaim=lambda: self.reclaim(0))
        return self.encoder

    def reclaim(self, group: int) -> bool:
        """Evict the least recently used cached content of any group (balanced eviction across
        groups): a KV block, or an image encoding. Evicting a full-attention block also evicts
        the same content in sliding groups (aligned: a sliding block past a lost full-attention
        block can never be hit)."""
        best: BlockPool | None = None
        for pool in self.pools:
            if len(pool.evictor) and (best is None or pool.evictor.peek().last_used < best.evictor.peek().last_used):
                best = pool
        enc = self.encoder.oldest() if self.encoder is not None else None
        if enc is not None and (best is None or enc < best.evictor.peek().last_used):
            return self.encoder.evict_oldest()
        if best is None:  # only blocks that waiting requests will hit are left
            return self.pools[group].evict_held() or any(pool.evict_held() for pool in self.pools)
        block = best.evictor.pop()
        block_hash = block.block_hash
        best.evict(block)
        if self._sliding and block_hash is not None and best.chain_order:
            for m in self._sliding:
                twin = m.pool.index.get(block_hash)
                if twin is not None and twin.ref_cnt == 0 and twin in m.pool.evictor:
                    m.pool.evictor.remove(twin)
                    m.pool.evict(twin)
        return True

    def before_evict(self, group: int) -> None:
        """Hold what the step's waiting requests will hit (``PoolOwner``)."""
        self._protect_demand()

    def _protect_demand(self) -> None:
        if self.demand is None or self._demand_held or not self.enable_caching:
            return
        self._demand_held = True
        bs = self.block_size
        for rank, seq in enumerate(self.demand()):
            bound = (seq.num_tokens - 1) // bs
            hashes = self._hashes.get(seq.request_id)
            if hashes is None or len(hashes) < bound:
                hashes = self.block_hashes(seq)
            for m in self.managers:
                if m.pool.chain_order:  # full attention (sliding blocks are evicted by their own rule)
                    m.pool.hold(m.find_longest_hit(hashes, bound), rank)

    def end_step(self) -> None:
        """Forget the step's demand: held blocks go back to their policies."""
        self.demand = None
        if self._demand_held:
            self._demand_held = False
            for pool in self.pools:
                pool.release_held()

    def free_bytes(self) -> int:
        """Bytes that allocation could use now: free large pages plus every group's plain free
        and evictable blocks, and the pages image encodings would give back."""
        return ((self.pages.num_free() + self._encoder_reclaimable()) * self.layout.large_page_bytes
                + sum((len(p.plain_free) + p.num_evictable()) * m.spec.page_bytes
                      for p, m in zip(self.pools, self.managers)))

    def _encoder_reclaimable(self) -> int:
        return self.encoder.reclaimable_pages() if self.encoder is not None else 0

    def cache_blocks(self, seq: CacheableSequence, num_tokens: int | None = None, adopted: bool = False) -> None:
        """After a step ran: make ``seq``'s newly computed full blocks hittable (those among
        its first ``num_tokens``, default all computed ones). ``adopted``: their KV was loaded
        from elsewhere (a lower tier, another engine), not computed here (listeners do not
        write it through)."""
        if not self.enable_caching:
            return
        upto = seq.num_computed_tokens if num_tokens is None else min(num_tokens, seq.num_computed_tokens)
        full = upto // self.block_size
        if full <= self._cached_full.get(seq.request_id, 0):
            return  # no block filled since the last call (most decode steps)
        self._cached_full[seq.request_id] = full
        hashes, root = self._registrable_hashes(seq), self.root(seq)
        for m in self.managers:
            m.cache_blocks(seq, hashes, root, num_tokens, adopted)

    def trim(self, seq: CacheableSequence) -> None:
        """Free ``seq``'s blocks past the ones its ``num_tokens`` tokens need: after a verify
        step, blocks that held only rejected drafts. Only safe for blocks no one else
        references and that are not registered (drafts' blocks are fresh and never cached
        before their tokens are accepted)."""
        for m in self.managers:
            m.trim(seq.request_id, seq.num_tokens)
        if seq.request_id in self._tokens:
            self._tokens[seq.request_id] = min(self._tokens[seq.request_id], seq.num_tokens)

    def fork(self, parent: CacheableSequence, child: CacheableSequence) -> None:
        for m in self.managers:
            m.fork(parent, child)
        if parent.request_id in self._hashes:
            self._hashes[child.request_id] = list(self._hashes[parent.request_id])
        if parent.request_id in self._tokens:
            self._tokens[child.request_id] = self._tokens[parent.request_id]
        if parent.request_id in self._cached_full:
            self._cached_full[child.request_id] = self._cached_full[parent.request_id]

    def borrow(self, request_id: str, blocks: ComputedBlocks) -> None:
        """Reference cached ``blocks`` (per group, as ``prefix_blocks`` returns them) that
        ``request_id`` reads without owning them (a reused segment's source), so that no
        eviction takes them, until ``release_borrowed`` or ``free``. Safety rule: release only
        once every step that reads them has been launched."""
        for pool, h in zip(self.pools, blocks):
            pool.touch(h, hit=True)
        self._borrowed.setdefault(request_id, []).append(blocks)

    def release_borrowed(self, request_id: str) -> None:
        for blocks in reversed(self._borrowed.pop(request_id, [])):
            for pool, h in zip(self.pools, blocks):
                pool.free_blocks(reversed(h))

    def free(self, seq: CacheableSequence) -> None:
        self.release_borrowed(seq.request_id)
        for m in self.managers:
            m.free(seq)
        self._hashes.pop(seq.request_id, None)
        self._roots.pop(seq.request_id, None)
        self._cached_full.pop(seq.request_id, None)
        self._tokens.pop(seq.request_id, None)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """Block ids of every group's table."""
        return [m.block_ids(request_id) for m in self.managers]

    def block_tables(self, request_id: str) -> list[list[KVBlock]]:
        """The live tables, one per group: only valid until the sequence is next allocated,
        forked or freed."""
        return [m.tables.get(request_id, []) for m in self.managers]

    def num_held_blocks(self, request_id: str) -> int:
        return sum(m.num_held_blocks(request_id) for m in self.managers)

    def take_copies(self) -> list[tuple[int, int, int]]:
        copies = []
        for g, m in enumerate(self.managers):
            copies += [(g, src, dst) for src, dst in m.pending_copies]
            m.pending_copies = []
        return copies

    # -- observability -------------------------------------------------------------------
    def usage(self) -> CacheUsage:
        """The pool in large pages (blocks, for a single group): ``used`` pages hold a
        referenced block, ``cached`` pages only cached content (image encodings included),
        ``free`` pages nothing."""
        encodings = self.encoder.num_pages if self.encoder is not None else 0
        if len(self.pools) == 1 and self.pools[0].per_page == 1:
            pool = self.pools[0]
            cached = pool.num_evictable() + encodings
            total, free = self.pages.num_usable, self.pages.num_free()
            return CacheUsage(total=total, free=free, cached=cached, used=total - free - cached)
        referenced: set[int] = set()
        owned: set[int] = set()
        for pool in self.pools:
            for page, owner in enumerate(self.pages.owner):
                if owner == pool.group:
                    owned.add(page)
                    first = page * pool.per_page
                    if any(b.ref_cnt > 0 for b in pool.blocks[first: first + pool.per_page]):
                        referenced.add(page)
        total, free = self.pages.num_usable, self.pages.num_free()
        return CacheUsage(total=total, free=free, cached=len(owned) - len(referenced) + encodings,
                          used=len(referenced))

    def group_usage(self) -> list[CacheUsage]:
        """Each group's blocks in the large pages it holds."""
        return [p.usage() for p in self.pools]

    def memory_breakdown(self) -> dict:
        """Bytes held for running sequences and how much of it holds live tokens.

        ``live``: what each sequence's layers must hold (sliding layers only their window).
        Per sequence: a block that forks share counts once for each of them, in both figures.
        ``waste``: the rest of its referenced blocks (empty slots of last blocks, padding layer
        slots, tokens a homogeneous layout keeps past a window) plus free small pages inside
        large pages that hold a referenced block (fragmentation of the two-level pool).
        """
        referenced = sum(m.num_held_blocks(rid) * m.spec.page_bytes for m in self.managers for rid in m.tables)
        live = sum(self.layout.live_bytes(n) for n in self._tokens.values())
        fragment = 0  # free small pages inside large pages that running requests hold
        for p, m in zip(self.pools, self.managers):
            if p.per_page > 1:
                pages = {b.block_id // p.per_page for t in m.tables.values() for b in t if not b.is_null}
                fragment += sum(p.plain_free_in_page(page) for page in pages) * m.spec.page_bytes
        held = referenced + fragment
        waste = max(0, held - live)
        return {"held_bytes": held, "live_bytes": live, "fragmentation_bytes": fragment,
                "waste_bytes": waste, "waste_fraction": waste / held if held else 0.0}

    def top_prefixes(self, n: int = 10) -> list[dict]:
        """The ``n`` cached prefixes that prefix hits took most often, over every group
        (``BlockPool.top_hit_blocks``), most hit first: per prefix its ``group``, ``hits``,
        ``tokens`` (the chain's length up to and including its last block), ``state`` (``used``:
        a request or pin holds it now; else ``cached``) and ``hash`` (hex of the last block's
        chained hash). Token ids never leave the cache. Scans the cached blocks: for an
        operator's view, never per step."""
        rows = [{"group": g, "hits": b.num_hits, "tokens": (b.depth + 1) * self.block_size,
                 "state": "used" if b.ref_cnt else "cached", "hash": b.block_hash.hex()}
                for g, pool in enumerate(self.pools) for b in pool.top_hit_blocks(n) if b.block_hash is not None]
        rows.sort(key=lambda r: (-r["hits"], -r["tokens"], r["group"]))
        return rows[:n]

    def reset_prefix_cache(self) -> int:
        dropped = sum(p.reset_prefix_cache() for p in self.pools)
        if self.events is not None and not any(len(p.index) for p in self.pools):
            self.events.cleared()
        return dropped

    # -- KV events -------------------------------------------------------------------------
    @property
    def events(self) -> KVEventLog | None:
        return self._events

    def enable_events(self, engine_id: str = "engine-0") -> KVEventLog:
        """Log every registration and eviction from now on (call before anything is cached, so
        that the log's batches describe the whole index)."""
        if any(len(p.index) for p in self.pools):
            raise RuntimeError("enable_events: blocks are already cached")
        log = self._events = KVEventLog(engine_id)
        if self._event_listener is None:
            self._event_listener = EventLogListener(log, self.block_size)
            self.add_listener(self._event_listener)
        self._event_listener.log = log
        return log

    def event_snapshot(self) -> KVSnapshot:
        """Every group's cached hashes as of the last drained batch (see ``KVEventLog.snapshot``)."""
        assert self.events is not None
        return self.events.snapshot([set(p.index.hashes()) for p in self.pools])

    def stats(self) -> dict:
        return {"block_size": self.block_size, "page_bytes": self.layout.large_page_bytes,
                **self.usage().as_dict(), **self.counters.as_dict(), "kv_layout": self.layout.mode,
                "groups": [{**d, **u.as_dict()} for d, u in zip(self.layout.describe(), self.group_usage())],
                "memory": self.memory_breakdown(),
                **({"encoder": self.encoder.stats()} if self.encoder is not None else {})}
