"""Property-based tests of image encodings held in the KV pool's pages (``EncoderPages``) beside
a KV group, under random requests, frees and images (pure Python, no model).

A shadow memory records, per encoder slot, what was last written there: an encoding's key when
it is reserved, ``"kv"`` for every slot of a page a KV block was allocated in. A cached encoding
read back must find its own key in each of its slots, so a page given to KV while an encoding
still claimed it (or two encodings sharing a slot) shows up as wrong content. KV allocation fails
only where dropping every encoding would not have made room, and an encoding finds none only past
its quota or what the pool can evict: the two kinds of content trade pages."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvos.cache import KVCacheManager
from kvos.cache.spec import FullAttentionSpec
from tests.support.kv_sequences import Seq


class EncoderPagesMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(3, 10), split=st.sampled_from([1, 2, 4]), quota=st.integers(1, 10))
    def setup(self, num_pages, split, quota) -> None:
        spec = FullAttentionSpec(block_size=2, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
        self.kv = KVCacheManager(spec, num_pages, model_id="m")
        self.slot = spec.page_bytes // split
        self.enc = self.kv.attach_encoder(self.slot, min(quota, num_pages - 1))
        self.shadow: dict[int, str] = {}
        self.active: list[Seq] = []
        self.n = 0

    def _mark_kv(self, seq: Seq) -> None:
        per = self.enc.slots_per_page
        for block in self.kv.block_tables(seq.request_id)[0]:
            if not block.is_null:
                for s in range(block.block_id * per, (block.block_id + 1) * per):
                    self.shadow[s] = "kv"

    @rule(tokens=st.lists(st.integers(1, 3), min_size=1, max_size=9))
    def request(self, tokens) -> None:
        self.n += 1
        seq = Seq(f"r{self.n}", tokens)
        hit, n = self.kv.get_computed_blocks(seq)
        if not self.kv.allocate_slots(seq, seq.num_tokens - n, hit):
            if self.enc.clear():  # KV took encodings' pages before it gave up: without them it fails too
                assert not self.kv.allocate_slots(seq, seq.num_tokens - n, self.kv.get_computed_blocks(seq)[0])
            return
        seq.num_computed_tokens = seq.num_tokens
        self._mark_kv(seq)
        self.kv.cache_blocks(seq)
        self.active.append(seq)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 99))
    def free(self, i) -> None:
        self.kv.free(self.active.pop(i % len(self.active)))

    @rule(keys=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=3), size=st.integers(1, 3))
    def step_with_images(self, keys, size) -> None:
        """As ``plan_encodings`` does for one step: cached ones pinned and read, new ones reserved."""
        nbytes = size * self.slot - 1
        planned: dict[str, tuple[bool, list[int]]] = {}
        for key in keys:
            if key in planned:
                continue
            slots = self.enc.lookup(key)
            if slots is not None:
                self.enc.pin(key)
                planned[key] = (True, slots)
            else:
                slots = self.enc.reserve(key, nbytes)
                if slots is None:  # only past the quota, or when the pool cannot give the pages
                    pages = -(-(-(-nbytes // self.slot)) // self.enc.slots_per_page)
                    pinned = self.enc.num_pages - self.enc.reclaimable_pages()
                    room = self.kv.pages.num_free() + self.kv.pools[0].num_evictable() + self.enc.reclaimable_pages()
                    assert pages > min(self.enc.max_pages - pinned, room), (pages, pinned, room)
                planned[key] = (False, slots or [])
        for key, (cached, slots) in planned.items():  # the step runs: reads, then writes
            if cached:
                assert all(self.shadow.get(s) == key for s in slots), (key, slots)
        for key, (cached, slots) in planned.items():
            if not cached:
                assert not slots or len(slots) == -(-nbytes // self.slot)
                for s in slots:
                    self.shadow[s] = key
        self.enc.unpin_all()

    @invariant()
    def pages_have_one_owner(self) -> None:
        if not hasattr(self, "enc"):
            return
        pages = self.kv.pages
        held = {p for p, o in enumerate(pages.owner) if o == self.enc.group}
        assert held == set(self.enc._free) and len(held) <= self.enc.max_pages
        assert pages.num_free() + sum(o is not None for o in pages.owner) == pages.num_usable  # page 0: null blocks
        per = self.enc.slots_per_page
        seen: set[int] = set()
        for e in self.enc.entries.values():
            assert not seen & set(e.slots)
            seen |= set(e.slots)
            assert all(s // per in held for s in e.slots)
        for p in held:
            assert self.enc._used[p] == sum(1 for s in seen if s // per == p) > 0
            assert len(self.enc._free[p]) + self.enc._used[p] == per
        for seq in self.active:  # a running request's blocks are in pages of the KV group
            for block in self.kv.block_tables(seq.request_id)[0]:
                assert block.is_null or pages.owner[block.block_id] == 0


EncoderPagesMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=list(HealthCheck))
TestEncoderPages = EncoderPagesMachine.TestCase
