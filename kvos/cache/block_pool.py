"""One cache group's blocks: reference counts, the prefix index and eviction order."""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvos.cache.block import PROMPT_BLOCK, BlockHash, FreeBlockQueue, KVBlock
from kvos.cache.eviction import EvictionPolicy, LRUPolicy
from kvos.cache.listener import BlockPoolListener, PoolOwner
from kvos.cache.page_pool import LargePagePool
from kvos.cache.prefix_index import PrefixIndex
from kvos.cache.stats import CacheCounters, CacheUsage


class LogicalClock:
    """A counter shared by the groups of one pool, so recency compares across groups."""

    def __init__(self) -> None:
        self.now = 0

    def tick(self) -> int:
        self.now += 1
        return self.now


class BlockPool:
    """The blocks of one cache group, drawn from large pages of a shared ``LargePagePool``.

    Block ``i`` is small page ``i % per_page`` of large page ``i // per_page``; block 0 (in
    page 0) is the group's null block, padding for block tables. Unreferenced blocks with no
    cached content (``plain_free``) are reused first; a large page whose small pages are all
    plain free goes back to the shared pool at once. Unreferenced cached blocks are evictable.

    Chain order (full attention, ``chain_order``): a block is never evicted before the cached
    blocks that extend it, whatever the policy. An unreferenced cached block with unreferenced
    cached children is *parked* (not offered to the policy); it enters the policy when its last
    such child is evicted or taken. So the policy only ever sees leaves, and while any block is
    parked some leaf below it is in the policy. Sliding-window groups have no chain order (a
    sliding block's use does not depend on its parent): every evictable block is in the policy.

    Wiring (``kvos.cache.listener``): an ``owner`` given at construction chooses what to evict
    when no block is free (without one the pool evicts its own policy's choice); ``listeners``
    hear every registration and eviction. Nothing else is called back.

    Safety rules:
    - ``get_new_blocks`` only ever hands out blocks with ``ref_cnt == 0``: a referenced block is
      never evicted or overwritten.
    - ``cache_full_block`` only after every slot of the block has been (or is being, by a step
      already launched) written; a cached block is immutable until evicted.
    """

    def __init__(self, num_blocks: int | None = None, enable_caching: bool = True,
                 index: PrefixIndex | None = None, counters: CacheCounters | None = None,
                 policy: EvictionPolicy | None = None, pages: LargePagePool | None = None,
                 per_page: int = 1, group: int = 0, clock: LogicalClock | None = None,
                 chain_order: bool = True, owner: PoolOwner | None = None,
                 listeners: Sequence[BlockPoolListener] = ()) -> None:
        if pages is None:
            if num_blocks is None:
                raise ValueError("BlockPool needs num_blocks or a shared page pool")
            if num_blocks < 2:
                raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
            pages = LargePagePool(num_blocks)
        self.pages = pages
        self.per_page = per_page
        self.group = group
        self.num_blocks = pages.num_pages * per_page
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1
        self.plain_free = FreeBlockQueue([])
        self._plain_in_page = [0] * pages.num_pages
        self._owned_pages = 0
        self.evictor = policy if policy is not None else LRUPolicy()
        self.chain_order = chain_order
        self._parked: dict[int, KVBlock] = {}
        """Unreferenced cached blocks waiting for their unreferenced cached children."""
        self._free_children: dict[BlockHash, int] = {}
        """Per parent hash: its unreferenced cached children (in the policy, parked or held)."""
        self._held: dict[int, KVBlock] = {}
        """Evictable blocks taken out of the policy for this step because a waiting request will
        hit them; evicted only once the policy has nothing left, farthest in the queue first."""
        self._held_order: list[tuple[int, int, int]] = []  # heap of (-rank, -depth, block id)
        self._demand_rank: dict[int, int] = {}  # block id -> queue position of its first waiting user
        self._held_unoffered: set[int] = set()  # held straight from parked: never in the policy yet
        self.owner = owner
        self.listeners: list[BlockPoolListener] = list(listeners)
        self.index = index if index is not None else PrefixIndex()
        self.counters = counters if counters is not None else CacheCounters()
        self.clock = clock if clock is not None else LogicalClock()

    # -- queries -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks this group could hold if it had the whole pool."""
        return self.pages.num_usable * self.per_page

    def num_evictable(self) -> int:
        """Unreferenced cached blocks: in the policy or parked behind their children."""
        return len(self.evictor) + len(self._parked) + len(self._held)

    def plain_free_in_page(self, page: int) -> int:
        """Free blocks holding nothing in large page ``page`` (0 for a page of another group)."""
        return self._plain_in_page[page] if self.pages.owner[page] == self.group else 0

    def num_free_blocks(self) -> int:
        """Blocks this group can take now without evicting another group's content."""
        return len(self.plain_free) + self.num_evictable() + self.pages.num_free() * self.per_page

    def is_free(self, block: KVBlock) -> bool:
        """Unreferenced: plain free, evictable, or in a large page no group holds."""
        return (block.prev_free is not None or block in self.evictor or block.block_id in self._parked
                or block.block_id in self._held
                or self.pages.owner[block.block_id // self.per_page] != self.group)

    def is_parked(self, block: KVBlock) -> bool:
        return block.block_id in self._parked

    def usage(self) -> CacheUsage:
        """This group's own blocks (those in large pages it holds)."""
        free, cached = len(self.plain_free), self.num_evictable()
        total = self._owned_pages * self.per_page
        return CacheUsage(total=total, free=free, cached=cached, used=total - free - cached)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.index.get(block_hash) if self.enable_caching else None

    # -- allocation ----------------------------------------------------------------------
    def _split_page(self) -> bool:
        """Take a free large page and queue its small pages as plain free (first one first)."""
        page = self.pages.take(self.group)
        if page is None:
            return False
        self._owned_pages += 1
        first = page * self.per_page
        for block in reversed(self.blocks[first: first + self.per_page]):
            self.plain_free.appendleft(block)
        self._plain_in_page[page] = self.per_page
        return True

    def _take_block(self) -> KVBlock | None:
        while True:
            if len(self.plain_free):
                block = self.plain_free.popleft()
                self._plain_in_page[block.block_id // self.per_page] -= 1
                return block
            if self._split_page():
                continue
            if self.owner is not None:
                self.owner.before_evict(self.group)
                if not self.owner.reclaim(self.group):
                    return None
            elif not self.evict_one():
                return None

    def add_listener(self, listener: BlockPoolListener) -> None:
        """Add a listener to those given at construction (for one built after the pool: the KV
        event log, the tier connector, which need the engine's scheduler first)."""
        self.listeners.append(listener)

    def evict_one(self) -> bool:
        """Evict the policy's choice, or else the held block wanted farthest in the future;
        False if nothing is evictable."""
        if len(self.evictor):
            self.evict(self.evictor.pop())
            return True
        return self.evict_held()

    def hold(self, blocks: list[KVBlock], rank: int) -> None:
        """The ``rank``-th waiting request will hit ``blocks`` (a chain from its root): take the
        evictable ones out of the policy until ``release_held`` (a parked one is held when its
        children go). Call in rank order."""
        for block in reversed(blocks):
            if block.block_id in self._demand_rank:
                break  # so are its ancestors: an earlier waiting request's hit holds the whole chain
            if block.ref_cnt or block.block_hash is None or block.is_null:
                continue
            self._demand_rank[block.block_id] = rank
            if block.block_id not in self._parked:
                self.evictor.remove(block)
                self._hold(block)

    def _hold(self, block: KVBlock) -> None:
        self._held[block.block_id] = block
        heapq.heappush(self._held_order, (-self._demand_rank[block.block_id], -block.depth, block.block_id))

    def _pop_held(self) -> KVBlock:
        """The held block whose first waiting user is farthest back (deepest first)."""
        while True:
            _, _, block_id = heapq.heappop(self._held_order)
            block = self._held.pop(block_id, None)
            if block is not None:
                return block

    def evict_held(self) -> bool:
        """Evict the held block wanted farthest in the future; False if none is held."""
        if not self._held:
            return False
        self.evict(self._pop_held())
        return True

    def release_held(self) -> None:
        for block in self._held.values():
            if block.block_id in self._held_unoffered:
                self.evictor.add(block)
            else:
                self.evictor.restore(block)
        self._held.clear()
        self._held_unoffered.clear()
        self._held_order.clear()
        self._demand_rank.clear()

    def _take_near(self, near: KVBlock | None) -> KVBlock | None:
        """A plain free block in the large page of ``near`` (a block of the same request), so
        that a request's blocks share pages and its pages free whole when it ends."""
        if near is None or near.is_null or self.per_page == 1:
            return None
        page = near.block_id // self.per_page
        if not self._plain_in_page[page]:
            return None
        first = page * self.per_page
        for block in self.blocks[first: first + self.per_page]:
            if block.prev_free is not None and block.block_hash is None:  # plain free, not cached
                self.plain_free.remove(block)
                self._plain_in_page[page] -= 1
                return block
        return None

    OWN_PAGE_MAX_BLOCKS = 64
    """A request starts a large page of its own only when a page holds at most this many of the
    group's blocks; a larger page (one Mamba state page is worth over a thousand KV blocks of a
    hybrid's few attention layers) is shared by several requests' blocks, or short requests
    would each pin a page that other groups need."""

    def get_new_blocks(self, n: int, near: KVBlock | None = None) -> list[KVBlock]:
        """Take ``n`` blocks (evicting cached content if needed), each with ref 1, packed into
        the large page of ``near`` (the request's last block) while it has room, then into a
        fresh large page while any is free (pages of at most ``OWN_PAGE_MAX_BLOCKS`` blocks),
        then wherever a small page is free (Jenga's request-aware allocation). On failure (the
        pool is full of referenced blocks) nothing is taken and ValueError is raised."""
        out: list[KVBlock] = []
        own_page = 1 < self.per_page <= self.OWN_PAGE_MAX_BLOCKS
        for _ in range(n):
            block = self._take_near(near)
            if block is None and (own_page or (self.per_page > 1 and not len(self.plain_free))) \
                    and self._split_page():
                block = self._take_near(self.plain_free.peekleft())  # a page of its own while any is free
            block = block or self._take_block()
            near = block
            if block is None:
                self.release_fresh(out)
                raise ValueError(f"cannot allocate {n} blocks in group {self.group}")
            block.ref_cnt = 1
            out.append(block)
        return out

    def release_fresh(self, blocks: list[KVBlock]) -> None:
        """Undo ``get_new_blocks`` for blocks nothing has written or shared yet."""
        for block in reversed(blocks):
            block.ref_cnt = 0
            self._to_plain(block)

    def _to_plain(self, block: KVBlock) -> None:
        """An unreferenced block without content becomes plain free; its large page goes back
        to the shared pool once all its small pages are plain free."""
        page = block.block_id // self.per_page
        self.plain_free.appendleft(block)
        self._plain_in_page[page] += 1
        if self._plain_in_page[page] == self.per_page:
            first = page * self.per_page
            for b in self.blocks[first: first + self.per_page]:
                self.plain_free.remove(b)
            self._plain_in_page[page] = 0
            self._owned_pages -= 1
            self.pages.give_back(page)

    def evict(self, block: KVBlock) -> None:
        """Drop the cached content of an unreferenced block already taken out of the policy;
        it becomes plain free."""
        assert block.ref_cnt == 0 and block.block_hash is not None
        for listener in self.listeners:
            listener.block_evicting(self.group, block)
        self._child_left(block)
        self.index.remove(block.block_hash)
        block.block_hash = block.parent_hash = None
        block.num_hits = 0
        self.counters.evictions += 1
        self._to_plain(block)

    def touch(self, blocks: Iterable[KVBlock], hit: bool = False, priority: int | None = None) -> None:
        """Take a reference on each block (``hit``: a prefix-cache hit by a request of
        ``priority``; else a fork), reviving unreferenced ones from the free lists. Pass a chain
        root first."""
        now = self.clock.tick()
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    if hit:
                        self.evictor.on_hit(block, now)
                    if (self._parked.pop(block.block_id, None) is None
                            and self._held.pop(block.block_id, None) is None):
                        self.evictor.remove(block)
                    self._child_left(block)
                else:
                    self.plain_free.remove(block)
                    self._plain_in_page[block.block_id // self.per_page] -= 1
            if hit:
                block.num_hits += 1
                block.last_used = now
                if priority is not None and block.block_hash is not None:
                    block.priority = min(block.priority, priority)
            block.ref_cnt += 1

    def note_uses(self, blocks: list[KVBlock]) -> None:
        """Unreferenced cached ``blocks`` (a chain, root first) were used where they lie, with no
        reference taken (a tier's copies loaded, or stored again): the policy hears each hit at
        one time, root first (``on_hit``), those in it leave it and come back tail first with
        their new last use, as ``touch`` then ``free_blocks`` show a request's prefix hit. Chain
        order is left as it is: a parked block stays parked, a held one held, and no parent is
        offered meanwhile (``touch`` of a chain's later blocks alone would offer it)."""
        if not blocks:
            return
        now = self.clock.tick()
        taken: list[tuple[KVBlock, bool]] = []
        for block in blocks:
            if block.ref_cnt or block.block_hash is None:
                raise ValueError(f"note_uses of a referenced or uncached block {block}")
            self.evictor.on_hit(block, now)
            in_policy = block.block_id not in self._parked and block.block_id not in self._held
            if in_policy:
                self.evictor.remove(block)
            block.num_hits += 1
            block.last_used = now
            taken.append((block, in_policy))
        for block, in_policy in reversed(taken):
            block.last_used = self.clock.tick()
            if block.block_id in self._held:
                self._held_unoffered.add(block.block_id)  # the policy counts the use on release
            elif in_policy:
                self.evictor.add(block)

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those reaching 0 become evictable (cached) or
        plain free, in the given order. Pass a request's blocks tail first."""
        for block in ordered:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    block.last_used = self.clock.tick()
                    self._make_evictable(block)
                else:
                    self._to_plain(block)

    def _make_evictable(self, block: KVBlock) -> None:
        if not self.chain_order:
            self.evictor.add(block)
            return
        if self._free_children.get(block.block_hash):  # type: ignore[arg-type]
            self._parked[block.block_id] = block
        else:
            self.evictor.add(block)
        parent_hash = block.parent_hash
        if parent_hash is not None:
            self._free_children[parent_hash] = self._free_children.get(parent_hash, 0) + 1
            parent = self.index.get(parent_hash)
            if parent is not None and parent.ref_cnt == 0 and parent.block_id not in self._parked:
                # a chain built on another copy of the parent's content
                if self._held.pop(parent.block_id, None) is None:
                    self.evictor.remove(parent)
                self._parked[parent.block_id] = parent

    def _child_left(self, block: KVBlock) -> None:
        """``block``, unreferenced and cached, is being evicted or taken: its parent may become
        a leaf (and enter the policy)."""
        parent_hash = block.parent_hash
        if not self.chain_order or parent_hash is None:
            return
        left = self._free_children[parent_hash] - 1
        if left:
            self._free_children[parent_hash] = left
            return
        del self._free_children[parent_hash]
        parent = self.index.get(parent_hash)
        if parent is not None and self._parked.pop(parent.block_id, None) is not None:
            if parent.block_id in self._demand_rank:
                self._hold(parent)
                self._held_unoffered.add(parent.block_id)
            else:
                self.evictor.add(parent)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash, depth: int = 0,
                         priority: int = 0, adopted: bool = False, kind: int = PROMPT_BLOCK) -> None:
        """Register a referenced, full block (``depth``-th of its chain, cached by a request of
        ``priority``; ``adopted``: its KV came from another engine; ``kind``: ``KVBlock.kind``) under its chained hash
        (no-op if caching is off, the block is already cached, or another block already holds
        this content)."""
        if not self.enable_caching or block.block_hash is not None or block.is_null:
            return
        if self.index.insert(block_hash, block):
            block.block_hash = block_hash
            block.parent_hash = parent_hash
            block.depth = depth
            block.priority = priority
            block.kind = kind
            block.cached_at = self.clock.tick()
            for listener in self.listeners:
                listener.block_cached(self.group, block, adopted)

    def top_hit_blocks(self, n: int) -> list[KVBlock]:
        """The cached blocks that prefix hits took most often (``num_hits``, counted by ``touch``),
        at most ``n``, most hit first (deeper first on ties). A hit takes a chain from its root,
        so a block's ancestors have at least its hits: an ancestor with exactly as many is the
        same prefix, shorter, and is left out; one with more (a prefix shared by several longer
        ones) is listed on its own. Scans the cached blocks (an operator's view, never per step)."""
        if n <= 0:
            return []
        heap = [(-b.num_hits, -b.depth, b.block_id) for b in self.index.blocks() if b.num_hits]
        heapq.heapify(heap)
        out: list[KVBlock] = []
        covered: set[int] = set()
        while heap and len(out) < n:
            _, _, block_id = heapq.heappop(heap)
            if block_id in covered:
                continue
            block = self.blocks[block_id]
            out.append(block)
            parent = self.index.get(block.parent_hash) if block.parent_hash is not None else None
            while parent is not None and parent.num_hits == block.num_hits and parent.block_id not in covered:
                covered.add(parent.block_id)
                parent = self.index.get(parent.parent_hash) if parent.parent_hash is not None else None
        return out

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block's content; returns how many were dropped."""
        dropped = 0
        while len(self.evictor):
            self.evict(self.evictor.pop())
            dropped += 1
        return dropped
