"""Property-based tests of a pool holding KV and Mamba state groups (pure Python, no model).

The hybrid machine's rules (start with prefix hits, append, fork, free, abort, forced eviction)
over a layout of a full-attention group and a Mamba state group of another page size. The shadow
memory stores, in a state block, the *prefix* it summarises: a step reads the state of its last
computed token and writes the state at each boundary it crosses (where the table has a page) and
after its last token, as the runner does (``kvos.models.state.state_metadata``). So a restored
state that is not the one computed from scratch for that prefix, a state block written while
shared, or one reused while referenced, shows up as wrong content read back.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from kvos.cache import KVCacheManager, build_layout
from kvos.cache.mamba_state import MambaStateManager
from kvos.cache.spec import MambaStateSpec
from kvos.models.state import state_metadata
from tests.cache.test_hybrid_kv_properties import HybridKVMachine, Seq


class StateKVMachine(HybridKVMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), attn_layers=st.integers(0, 2),
                state_layers=st.integers(1, 3), every=st.integers(1, 3), num_pages=st.integers(3, 12))
    def setup(self, block_size, attn_layers, state_layers, every, num_pages) -> None:
        self.bs = block_size
        n = attn_layers + state_layers
        spec = MambaStateSpec(block_size, state_layers, conv_dim=3, conv_width=1, num_heads=1, head_dim=1,
                              state_size=attn_layers + 1, cache_every=every)
        self.layout = build_layout([None] * n, block_size, 1, 1, "float32", "unified", spec,
                                   tuple(range(attn_layers, n)))
        self.kv = KVCacheManager(self.layout, num_pages, model_id="m")
        self.large = self.layout.large_page_bytes
        self.mem = {}
        self.active = []
        self.n = 0
        self.state_group = len(self.layout.groups) - 1
        assert isinstance(self.kv.managers[self.state_group], MambaStateManager)

    def _compute(self, seq: Seq, start: int, end: int) -> None:
        self._apply_copies()
        tables = self.kv.block_tables(seq.request_id)
        for g, table in enumerate(tables):
            if g == self.state_group:
                continue
            for pos in range(start, end):
                block = table[pos // self.bs]
                assert block.ref_cnt >= 1 and not block.is_null, (g, pos, block)
                self._write(g, block.block_id, pos % self.bs, (seq.cache_salt, seq.all_token_ids[pos]))
        table = tables[self.state_group]
        ids = [0 if b.is_null else b.block_id for b in table]
        meta = state_metadata(self.bs, [start], [end - start], [ids], 0).seqs[0]
        if start:
            assert self._read(self.state_group, meta.read_block, 0) == self._state(seq, start), "stale state read"
        for n, block_id in meta.saves:
            block = next(b for b in table if b.block_id == block_id)
            assert block.ref_cnt == 1 and block.block_hash is None, "a state write into a shared or cached block"
            self._write(self.state_group, block_id, 0, self._state(seq, start + n))
        seq.num_computed_tokens = end
        self.kv.cache_blocks(seq)

    @staticmethod
    def _state(seq: Seq, num_tokens: int) -> tuple:
        return seq.cache_salt, tuple(seq.all_token_ids[:num_tokens])

    def _window(self, group: int) -> int | None:
        return None

    def _check_content(self, seq: Seq) -> None:
        c = seq.num_computed_tokens
        for g, table in enumerate(self.kv.block_tables(seq.request_id)):
            if g == self.state_group:
                if c:
                    block = table[(c - 1) // self.bs]
                    assert not block.is_null, (seq.request_id, c)
                    assert self._read(g, block.block_id, 0) == self._state(seq, c), (seq.request_id, c)
                continue
            for pos in range(c):
                block = table[pos // self.bs]
                got = self._read(g, block.block_id, pos % self.bs)
                assert got == (seq.cache_salt, seq.all_token_ids[pos]), (seq.request_id, g, pos, got)

    @invariant()
    def sliding_groups_hold_only_the_window(self) -> None:
        """A state table holds no page behind the current block once allocated again."""
        for seq in getattr(self, "active", []):
            table = self.kv.block_tables(seq.request_id)[self.state_group]
            dead = max(0, seq.computed_at_allocate - 1) // self.bs
            assert all(b.is_null for b in table[:dead]), (dead, table)


TestStateKVMachine = StateKVMachine.TestCase
TestStateKVMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


def test_state_hit_restores_the_last_checkpoint_of_the_prefix():
    """With checkpoints every 2 blocks, a prompt sharing 7 blocks hits at 6 (the last state kept),
    needs only that block of the state table, and the attention group agrees on the length."""
    spec = MambaStateSpec(4, 1, conv_dim=2, conv_width=1, num_heads=1, head_dim=1, state_size=1, cache_every=2)
    layout = build_layout([None, None], 4, 1, 1, "float32", "unified", spec, (1,))
    kv = KVCacheManager(layout, 16, model_id="m")
    first = Seq("a", list(range(30)), None)
    assert kv.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    kv.cache_blocks(first)
    state_table = kv.block_tables("a")[1]
    assert [not b.is_null for b in state_table] == [False, True, False, True, False, True, False, True]
    kv.free(first)
    second = Seq("b", list(range(28)) + [99, 99, 99], None)
    hit, tokens = kv.get_computed_blocks(second)
    assert tokens == 24  # blocks 0-5: the state after block 5 was kept (block 6's was not)
    assert [b.is_null for b in hit[1]] == [True] * 5 + [False]
