"""Image encodings held in the KV pool's own large pages: a cache group beside the KV groups, so
that encodings and KV blocks trade pages under one least-recently-used order. Pure Python: the
runner reads and writes the bytes (``StepDescription.encodings``)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvos.cache.block_pool import LogicalClock
from kvos.cache.page_pool import LargePagePool


@dataclass
class EncodingEntry:
    slots: list[int]
    last_used: int


class EncoderPages:
    """Encodings by key (``MediaItem.key``: content hash salted per tenant) in slots of large pages.

    A large page taken from the shared ``LargePagePool`` is cut into ``slots_per_page`` slots of
    ``slot_bytes``; an encoding of n bytes takes ``ceil(n / slot_bytes)`` slots, anywhere in the
    pages this group holds. A slot's flat index is ``page * slots_per_page + slot``, so its bytes
    are ``[index * slot_bytes, (index + 1) * slot_bytes)`` of the page-major pool buffer.

    Invariants: the group holds a page iff one of its slots belongs to an entry; a pinned entry is
    never evicted; entries leave least recently used first (``last_used`` on the pool's clock,
    which ``KVCacheManager.reclaim`` compares with KV blocks'); the group holds at most
    ``max_pages`` pages (the pool's quota for it). Safety rule: slots handed out by ``lookup`` or
    ``reserve`` are only read or written by the step planned with them (a later step's
    allocations run after it on the device's stream)."""

    def __init__(self, pages: LargePagePool, group: int, slot_bytes: int, slots_per_page: int,
                 clock: LogicalClock, max_pages: int, reclaim: Callable[[], bool] | None = None) -> None:
        self.pages, self.group, self.clock = pages, group, clock
        self.slot_bytes, self.slots_per_page, self.max_pages = slot_bytes, slots_per_page, max_pages
        pages.quota[group] = max_pages
        self.reclaim = reclaim
        """Evicts the pool's least recently used cached content (a KV block, or an encoding
        here); False when nothing is evictable. Set by the KV manager."""
        self.entries: OrderedDict[str, EncodingEntry] = OrderedDict()
        self._free: dict[int, list[int]] = {}  # page held -> its free slots
        self._used: dict[int, int] = {}  # page held -> slots in use
        self._pinned: set[str] = set()
        self.hits = 0
        self.evictions = 0

    @property
    def num_pages(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values()) * self.slot_bytes

    def lookup(self, key: str) -> list[int] | None:
        """The slots of a cached encoding (now most recently used), or None."""
        e = self.entries.get(key)
        if e is None:
            return None
        self.entries.move_to_end(key)
        e.last_used = self.clock.tick()
        self.hits += 1
        return e.slots

    def pin(self, key: str) -> None:
        self._pinned.add(key)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def reserve(self, key: str, nbytes: int) -> list[int] | None:
        """Slots for a new encoding of ``nbytes`` (pinned until ``unpin_all``): free slots of held
        pages, then fresh pages (up to ``max_pages``, evicting the pool's oldest content where
        none is free), then this group's own oldest entries. None when it cannot fit (the encoder
        still runs; its output is not kept)."""
        need = -(-nbytes // self.slot_bytes)
        if key in self.entries or need > self.max_pages * self.slots_per_page:
            return None
        while self._free_count() < need:
            if self.num_pages < self.max_pages and self._take_page():
                continue
            if self.num_pages < self.max_pages and self.reclaim is not None and self.reclaim():
                continue
            if not self.evict_oldest():
                self._drop_empty_pages()
                return None
        slots: list[int] = []
        for page in sorted(self._free, key=lambda p: -self._used[p]):  # fill used pages first
            free = self._free[page]
            while free and len(slots) < need:
                slots.append(free.pop())
                self._used[page] += 1
            if len(slots) == need:
                break
        self.entries[key] = EncodingEntry(slots, self.clock.tick())
        self._pinned.add(key)
        return slots

    def oldest(self) -> int | None:
        """``last_used`` of the entry ``evict_oldest`` would drop, or None."""
        for key, e in self.entries.items():
            if key not in self._pinned:
                return e.last_used
        return None

    def evict_oldest(self) -> bool:
        """Drop the least recently used unpinned entry (its emptied pages go back); False if none."""
        key = next((k for k in self.entries if k not in self._pinned), None)
        if key is None:
            return False
        for s in self.entries.pop(key).slots:
            page = s // self.slots_per_page
            self._free[page].append(s)
            self._used[page] -= 1
        self.evictions += 1
        self._drop_empty_pages()
        return True

    def clear(self) -> int:
        """Drop every unpinned entry; returns how many."""
        n = 0
        while self.evict_oldest():
            n += 1
        return n

    def reclaimable_pages(self) -> int:
        """Pages that evicting every unpinned entry would give back to the pool."""
        per = self.slots_per_page
        kept = {s // per for key in self._pinned if key in self.entries for s in self.entries[key].slots}
        return sum(1 for p in self._free if p not in kept)

    def _free_count(self) -> int:
        return sum(len(f) for f in self._free.values())

    def _take_page(self) -> bool:
        page = self.pages.take(self.group)
        if page is None:
            return False
        first = page * self.slots_per_page
        self._free[page] = list(range(first + self.slots_per_page - 1, first - 1, -1))
        self._used[page] = 0
        return True

    def _drop_empty_pages(self) -> None:
        for page in [p for p, n in self._used.items() if n == 0]:
            del self._free[page], self._used[page]
            self.pages.give_back(page)

    def stats(self) -> dict:
        page_bytes = self.slot_bytes * self.slots_per_page
        return {"encoder_cache_hits": self.hits, "encoder_cache_evictions": self.evictions,
                "encoder_cache_entries": len(self.entries), "encoder_cache_bytes": self.used_bytes,
                "encoder_cache_pages": self.num_pages, "encoder_cache_capacity_bytes": self.max_pages * page_bytes}
