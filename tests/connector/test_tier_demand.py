"""The CPU tier evicts last what waiting requests will hit (``tier_lookahead``)."""
from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvos import SamplingParams
from kvos.cache.tiers import SlotArena
from kvos.cache.tiers.arena import DEFAULT_CHUNK_BYTES

KEYS = [bytes([i]) * 16 for i in range(6)]


class ReferenceArena:
    """The rule spelled out: keys in LRU order; evict the least recently used key the demand
    does not name, else the named key with the largest (rank, depth), least recently used
    first among equals."""

    def __init__(self) -> None:
        self.order: list[bytes] = []
        self.demand: dict[bytes, tuple[int, int]] = {}

    def evict(self) -> bytes:
        free = [k for k in self.order if k not in self.demand]
        if free:
            key = free[0]
        else:
            best = max(self.demand[k] for k in self.order)
            key = next(k for k in self.order if self.demand[k] == best)
        self.order.remove(key)
        return key


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS)),
    st.tuples(st.just("put"), st.sampled_from(KEYS)),
    st.tuples(st.just("lookup"), st.sampled_from(KEYS)),
    st.tuples(st.just("drop"), st.sampled_from(KEYS)),
    st.tuples(st.just("demand"), st.dictionaries(st.sampled_from(KEYS),
                                                 st.tuples(st.integers(0, 3), st.integers(0, 3)))),
), min_size=10, max_size=80))
@example(ops=[("put", KEYS[0]), ("put", KEYS[1]), ("put", KEYS[2]),
              ("demand", {KEYS[0]: (2, 3), KEYS[4]: (0, 0), KEYS[1]: (2, 3)}),
              ("put", KEYS[4]), ("lookup", KEYS[0]), ("put", KEYS[2])])  # a wanted key used, then set aside again
def test_arena_evicts_like_the_reference_rule(ops):
    arena = SlotArena(8, capacity_bytes=3 * 64, chunk_bytes=DEFAULT_CHUNK_BYTES)  # three slots
    ref = ReferenceArena()
    for op, arg in ops:
        if op == "put":
            if arg in arena:
                continue
            slot = arena.alloc()
            if slot is None:
                key, slot = arena.evict()
                assert key == ref.evict()
            arena.bind(arg, slot)
            ref.order.append(arg)
        elif op == "lookup":
            assert (arena.lookup(arg) is not None) == (arg in ref.order)
            if arg in ref.order:
                ref.order.remove(arg)
                ref.order.append(arg)
        elif op == "drop":
            arena.drop(arg)
            if arg in ref.order:
                ref.order.remove(arg)
        else:
            arena.set_demand(arg)
            ref.demand = arg
        assert len(arena) == len(ref.order) and all(k in arena for k in ref.order)


def test_engine_cpu_tier_keeps_a_waiting_requests_prefix(make_llm):
    """Five prompts queued at once, one running at a time, on a 12-block device over a 10-slot
    CPU tier (write-through). The first and the last share a 6-block prefix; three unrelated
    prompts between them store 18 more blocks. A plain LRU tier has dropped the shared prefix
    when the last prompt runs; with the lookahead the tier drops the others instead and serves
    the whole prefix. The output equals an engine without any cache."""
    bs = 16
    shared = [(7 * i) % 5000 + 100 for i in range(6 * bs)]
    prompts = [shared + [11, 12, 13]] + [[(i * 131 + j * 17) % 9000 + 200 for j in range(6 * bs + 3)]
                                         for i in range(1, 4)] + [shared + [21, 22, 23]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in make_llm(enable_prefix_caching=False).generate(
        prompts, sp, use_tqdm=False)]
    probe = make_llm(num_blocks=12)
    slot = -(-(probe.engine.runner.block_bytes + 64) // 64) * 64  # payload, header and alignment
    served = {}
    for lookahead in (0, 1024):
        llm = make_llm(num_blocks=12, max_num_seqs=1, eviction_lookahead=0, cpu_cache_gb=10.5 * slot / (1 << 30),
                       tier_lookahead=lookahead)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        served[lookahead] = outs[-1].metrics["cached_tokens_by_source"].get("cpu", 0)
        assert outs[-1].metrics["cached_tokens_by_source"].get("device", 0) == 0  # the device lost it
        assert llm.stats()["tiers"][0]["evictions"] > 0
    assert served == {0: 0, 1024: 6 * bs}


def test_tier_lookahead_is_validated():
    from kvos.config import EngineConfig

    with pytest.raises(ValueError, match="tier_lookahead"):
        EngineConfig(tier_lookahead=-1)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True), min_size=1, max_size=5),
       wanted=st.dictionaries(st.integers(0, 11), st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=8),
       digests=st.booleans())
def test_write_through_from_the_device_stores_like_one_put_at_a_time(batches, wanted, digests):
    """``TierIO.store_computed`` reserves slots for a whole batch before copying into them; the
    tier must end up holding exactly what storing the blocks with one ``put`` each would leave
    (the same evictions under the waiting queue's demand), with the same bytes."""
    from kvos.cache.tiers import CPUTier, TierHierarchy
    from kvos.connector.tier_io import TierIO, host_digest
    from tests.connector.test_tiers import kv_runner

    runner = kv_runner(num_blocks=12)
    bb = runner.block_bytes
    slot = -(-(bb + 64) // 64) * 64

    def tier() -> CPUTier:
        t = CPUTier(4 * slot, digest_fn=host_digest if digests else None)  # four slots
        t.set_demand({bytes([k]) * 16: v for k, v in wanted.items()})
        return t

    direct, one_by_one = tier(), tier()
    tio = TierIO(TierHierarchy([direct]), runner, verify_threads=1)
    rows = runner.read_blocks(list(range(12)))
    for batch in batches:
        keys = [bytes([b]) * 16 for b in batch]
        tio.store_computed(keys, batch, None)
        for k, b in zip(keys, batch):
            one_by_one.put(k, rows[b].numpy().data, host_digest(rows[b].numpy().data))
    tio.close()
    held = [bytes([b]) * 16 for b in range(12) if one_by_one.contains(bytes([b]) * 16)]
    assert [k for k in (bytes([b]) * 16 for b in range(12)) if direct.contains(k)] == held
    for k in held:
        assert bytes(direct.get(k)) == bytes(one_by_one.get(k))
