"""Property-based tests of several cache groups in one pool (pure Python, no model).

A state machine interleaves start (with prefix hits), append (across the window), fork, free,
abort and forced eviction on a ``KVCacheManager`` with a full-attention group and a
sliding-window group of other page sizes, in each layout. A shadow memory models the *bytes*
of the large pages: a write through one group's block clobbers whatever another block (of any
group) kept in the overlapping bytes, so two live blocks sharing memory, a referenced block
reused, or a sliding block released while a future token still needs it all show up as wrong
content read back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvos.cache import KVCacheManager, build_layout
from kvos.cache.full_attention import cdiv


@dataclass(eq=False)
class Seq:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None
    num_computed_tokens: int = 0
    priority: int = 0
    computed_at_allocate: int = 0  # num_computed_tokens when its table was last allocated
    extra: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=30)
salts = st.sampled_from([None, "tenant-a"])


class HybridKVMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), window=st.integers(1, 9),
                full_layers=st.integers(1, 3), sliding_layers=st.integers(1, 7),
                mode=st.sampled_from(["unified", "equal_pages"]), num_pages=st.integers(3, 16))
    def setup(self, block_size, window, full_layers, sliding_layers, mode, num_pages) -> None:
        self.bs = block_size
        windows = [None] * full_layers + [window] * sliding_layers
        self.layout = build_layout(windows, block_size, 1, 1, "float32", mode)
        self.kv = KVCacheManager(self.layout, num_pages, model_id="m")
        self.large = self.layout.large_page_bytes
        self.mem: dict[int, dict[tuple[int, int], dict[int, tuple]]] = {}
        self.active: list[Seq] = []
        self.n = 0

    # -- the shadow memory -----------------------------------------------------------------
    def _extent(self, group: int, block_id: int) -> tuple[int, int, int]:
        """(large page, first byte, end byte) of a group's block."""
        per = self.layout.blocks_per_large_page(group)
        size = self.layout.groups[group].spec.page_bytes
        page, slot = divmod(block_id, per)
        return page, slot * size, (slot + 1) * size

    def _write(self, group: int, block_id: int, offset: int, value: tuple) -> None:
        page, lo, hi = self._extent(group, block_id)
        cells = self.mem.setdefault(page, {})
        for key in list(cells):
            if key != (group, block_id):
                _, olo, ohi = self._extent(*key)
                if olo < hi and lo < ohi:
                    del cells[key]  # the bytes now hold this block's data
        cells.setdefault((group, block_id), {})[offset] = value

    def _read(self, group: int, block_id: int, offset: int):
        page, _, _ = self._extent(group, block_id)
        return self.mem.get(page, {}).get((group, block_id), {}).get(offset)

    def _window(self, group: int) -> int | None:
        return getattr(self.layout.groups[group].spec, "window", None)

    def _apply_copies(self) -> None:
        """The copy-on-write copies the manager asks for, on the shadow."""
        for g, src, dst in self.kv.take_copies():
            for off in range(self.bs):
                value = self._read(g, src, off)
                if value is not None:
                    self._write(g, dst, off, value)

    def _compute(self, seq: Seq, start: int, end: int) -> None:
        self._apply_copies()
        for g, table in enumerate(self.kv.block_tables(seq.request_id)):
            for pos in range(start, end):
                block = table[pos // self.bs]
                assert block.ref_cnt >= 1 and not block.is_null, (g, pos, block)
                self._write(g, block.block_id, pos % self.bs, (seq.cache_salt, seq.all_token_ids[pos]))
        seq.num_computed_tokens = end
        self.kv.cache_blocks(seq)

    def _allocate(self, seq: Seq, num_new: int, hit=None) -> bool:
        ok = self.kv.allocate_slots(seq, num_new, hit)
        if ok:
            seq.computed_at_allocate = seq.num_computed_tokens
        return ok

    def _new_id(self) -> str:
        self.n += 1
        return f"s{self.n}"

    # -- rules -----------------------------------------------------------------------------
    @rule(tokens=tokens_st, salt=salts)
    def start(self, tokens, salt) -> None:
        seq = Seq(self._new_id(), list(tokens), salt)
        hit, hit_tokens = self.kv.get_computed_blocks(seq)
        assert hit_tokens <= seq.num_tokens - 1
        assert all(len(h) * self.bs == hit_tokens for h in hit), "groups disagree on the hit length"
        if self._allocate(seq, seq.num_tokens - hit_tokens, hit):
            seq.num_computed_tokens = hit_tokens
            self._check_content(seq)  # the hit serves exactly what the next token reads
            self._compute(seq, hit_tokens, seq.num_tokens)
            self.active.append(seq)
        else:
            assert not any(self.kv.block_tables(seq.request_id))
            self.kv.free(seq)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def append(self, i, more) -> None:
        """New tokens arrive; a sequence whose allocation fails keeps them uncomputed and
        retries them with its next append (tokens only grow, as in the engine)."""
        seq = self.active[i % len(self.active)]
        seq.all_token_ids.extend(more)
        start = seq.num_computed_tokens
        if self._allocate(seq, seq.num_tokens - start):
            self._compute(seq, start, seq.num_tokens)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 100))
    def fork(self, i) -> None:
        parent = self.active[i % len(self.active)]
        child = Seq(self._new_id(), list(parent.all_token_ids), parent.cache_salt, parent.num_computed_tokens,
                    parent.computed_at_allocate)
        self.kv.fork(parent, child)
        self.active.append(child)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 100))
    def free(self, i) -> None:
        self.kv.free(self.active.pop(i % len(self.active)))

    @rule(tokens=tokens_st, salt=salts)
    def abort_after_allocate(self, tokens, salt) -> None:
        seq = Seq(self._new_id(), list(tokens), salt)
        hit, hit_tokens = self.kv.get_computed_blocks(seq)
        self.kv.allocate_slots(seq, seq.num_tokens - hit_tokens, hit)
        self.kv.take_copies()
        self.kv.free(seq)
        assert not any(self.kv.block_tables(seq.request_id))

    @rule()
    def evict_everything_evictable(self) -> None:
        self.kv.reset_prefix_cache()

    # -- invariants ------------------------------------------------------------------------
    def _check_content(self, seq: Seq) -> None:
        """Every position a future token of ``seq`` reads holds ``seq``'s own token and salt."""
        c = seq.num_computed_tokens
        for g, table in enumerate(self.kv.block_tables(seq.request_id)):
            w = self._window(g)
            first = 0 if w is None else max(0, c - w + 1)
            for pos in range(first, c):
                block = table[pos // self.bs]
                assert not block.is_null, (seq.request_id, g, pos)
                got = self._read(g, block.block_id, pos % self.bs)
                assert got == (seq.cache_salt, seq.all_token_ids[pos]), (seq.request_id, g, pos, got)

    @invariant()
    def content_and_isolation(self) -> None:
        for seq in getattr(self, "active", []):
            self._check_content(seq)

    @invariant()
    def sliding_groups_hold_only_the_window(self) -> None:
        for seq in getattr(self, "active", []):
            for g, table in enumerate(self.kv.block_tables(seq.request_id)):
                w = self._window(g)
                if w is not None:
                    dead = max(0, seq.computed_at_allocate - w + 1) // self.bs
                    assert all(b.is_null for b in table[:dead]), (g, dead, table)

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "kv"):
            return
        pages = self.kv.pages
        u = self.kv.usage()
        assert u.total == u.free + u.cached + u.used == pages.num_usable
        owned = [0] * len(self.kv.pools)
        for page in range(1, pages.num_pages):
            if pages.owner[page] is not None:
                owned[pages.owner[page]] += 1
        assert sum(owned) + pages.num_free() == pages.num_usable
        for g, pool in enumerate(self.kv.pools):
            gu = pool.usage()
            assert gu.total == owned[g] * pool.per_page == gu.free + gu.cached + gu.used
            refs: dict[int, int] = {}
            for seq in self.active:
                for b in self.kv.block_tables(seq.request_id)[g]:
                    if not b.is_null:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
                        assert pages.owner[b.block_id // pool.per_page] == g, "a block in a page its group does not hold"
            assert gu.used == len(refs)
            for block in pool.blocks[pool.per_page:]:
                assert block.ref_cnt == refs.get(block.block_id, 0), (g, block)
                assert pool.is_free(block) == (block.ref_cnt == 0)
        m = self.kv.memory_breakdown()
        assert m["held_bytes"] >= m["live_bytes"] and 0 <= m["waste_fraction"] <= 1

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for seq in self.active:
            self.kv.free(seq)
        u = self.kv.usage()
        assert u.used == 0 and u.free + u.cached == u.total
        self.kv.reset_prefix_cache()
        assert self.kv.pages.num_free() == self.kv.pages.num_usable, "a large page was not given back"


TestHybridKVMachine = HybridKVMachine.TestCase
TestHybridKVMachine.settings = settings(max_examples=250, stateful_step_count=40, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])


def test_large_page_goes_to_another_group_once_free():
    """A page split for one group returns whole when its small pages are free and is then
    split for the other group."""
    layout = build_layout([None, 4, 4, 4], 2, 1, 1, "float32", "unified")  # pages of 1 and 3 layers
    assert layout.blocks_per_large_page(0) == 3 and layout.blocks_per_large_page(1) == 1
    kv = KVCacheManager(layout, 3, model_id="m", enable_caching=False)  # 2 usable large pages
    a = Seq("a", list(range(6)), None)
    assert not kv.allocate_slots(a, 6)  # full: 3 blocks = 1 large page; sliding: 3 blocks > 1 page left
    assert not any(kv.block_tables("a")), "all or nothing"
    b = Seq("b", list(range(2)), None)
    assert kv.allocate_slots(b, 2)
    assert kv.pages.num_free() == 0 and kv.pages.owner[1:] == [0, 1]
    kv.free(b)
    assert kv.pages.num_free() == 2
    c = Seq("c", list(range(2)), None)
    assert kv.allocate_slots(c, 2)
    assert kv.pages.owner[1:] == [1, 0], "each page now serves the other group"


def test_sliding_hit_needs_only_the_window():
    layout = build_layout([None, 4], 2, 1, 1, "float32", "unified")
    kv = KVCacheManager(layout, 64, model_id="m")
    a = Seq("a", list(range(20)), None)
    assert kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.cache_blocks(a)
    full, sliding = kv.block_tables("a")
    assert sum(not b.is_null for b in full) == 10
    kv.free(a)
    # a hit at 18 tokens needs the full group's 9 blocks but only the sliding blocks of 15..17
    b = Seq("b", list(range(20)), None)
    hit, n = kv.get_computed_blocks(b)
    assert n == 18
    assert [blk.is_null for blk in hit[1]] == [True] * 7 + [False] * 2
    assert all(not blk.is_null for blk in hit[0])
    # the sliding group loses block 8 (positions 16-17): 18 is no longer servable, 16 is (the
    # window before position 16 is blocks 6-7), and the full group agrees at 16
    pool = kv.pools[1]
    lost = pool.index.get(kv.block_hashes(b)[8])
    pool.evictor.remove(lost)
    pool.evict(lost)
    hit, n = kv.get_computed_blocks(b)
    assert n == 16 and len(hit[0]) == len(hit[1]) == 8
    assert [blk.is_null for blk in hit[1]] == [True] * 6 + [False] * 2
    assert cdiv(4 - 1, 2) == 2


def test_requests_decoding_together_keep_their_own_large_pages():
    """Request-aware packing: four requests decoding in lockstep (one block each in turn) still
    fill large pages of their own, so each request's full-attention blocks span
    ceil(blocks / per_page) pages and a finished request gives whole pages back."""
    layout = build_layout([None, 8, 8, 8, 8], 1, 1, 1, "float32", "unified")  # 4 full blocks per page
    per = layout.blocks_per_large_page(0)
    assert per == 4
    kv = KVCacheManager(layout, 64, model_id="m", enable_caching=False)
    seqs = [Seq(f"r{i}", [i], None) for i in range(4)]
    for step in range(12):
        for seq in seqs:
            if step:
                seq.all_token_ids.append(step)
            assert kv.allocate_slots(seq, 1)
            seq.num_computed_tokens += 1
    for seq in seqs:
        pages = {b.block_id // per for b in kv.block_tables(seq.request_id)[0]}
        assert len(pages) == 12 // per, (seq.request_id, pages)
    free_before = kv.pages.num_free()
    kv.free(seqs[0])
    assert kv.pages.num_free() >= free_before + 12 // per
    assert kv.memory_breakdown()["fragmentation_bytes"] == 0
