"""The engine's CPU tier evicts by the simulator's policy objects (``tier_eviction_policy``): the
same keys in the same order as the policy driven alone and as the simulated tier, LRU exactly
as before, and an engine with ``s3fifo`` serves prefixes from the tier with unchanged output."""
from __future__ import annotations

import itertools
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvos.cache.block import KVBlock
from kvos.cache.eviction import make_policy, online_policies
from kvos.cache.tiers import CPUTier
from kvos.cache.tiers.codec import HEADER_SIZE
from kvos.sim.tier import SimTier, SimTierConfig

KEYS = [bytes([i]) * 16 for i in range(8)]
PAYLOAD = 200
SLOTS = 4
SLOT = -(-(CPUTier._LEAD + HEADER_SIZE + PAYLOAD) // 64) * 64


def payload(key: bytes) -> bytes:
    return key[:1] * PAYLOAD


class Evictions:
    """Records the keys a tier evicts, in order (``EvictedFrameListener``)."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def frame_evicted(self, tier, key, frame) -> None:
        self.keys.append(key)


class PolicyOrder:
    """The CPU tier's rule spelled out on the policy object alone (no slots, no arena): a stored
    key is a fresh ``KVBlock`` whose ``cached_at`` then ``last_used`` are ticked before the policy
    gets it; a hit calls ``on_hit`` at a tick, takes the block out (unless held), counts the hit,
    ticks ``last_used`` and gives it back (a held one stays held); a demand set is applied at the
    next eviction: held blocks go back (``restore``, or ``add`` if stored or hit while held), then
    every stored key it names is held; an eviction pops the policy, else the held key with the
    largest (rank, depth), least recently used first. Storing a stored key is a hit."""

    def __init__(self, name: str, capacity: int) -> None:
        self.policy = make_policy(name, capacity=capacity)
        self.capacity = capacity
        self.blocks: dict[bytes, KVBlock] = {}
        self.ids = itertools.count()
        self.clock = itertools.count(1)
        self.demand: dict = {}
        self.applied: dict | None = None
        self.held: dict[bytes, str] = {}  # key -> how it goes back: "restore" or "add"

    def put(self, key: bytes, evict_wanted: bool = True) -> list[bytes] | None:
        """The keys evicted to store ``key`` (None: refused, only wanted keys could go); storing
        a stored key is a hit (its content was needed again)."""
        if key in self.blocks:
            self.hit(key)
            return []
        evicted = []
        if len(self.blocks) == self.capacity:
            victim = self.evict(evict_wanted)
            if victim is None:
                return None
            evicted.append(victim)
        block = KVBlock(next(self.ids), block_hash=key)
        block.cached_at = next(self.clock)
        block.last_used = next(self.clock)
        self.blocks[key] = block
        if self.applied is self.demand and key in self.demand:
            self.held[key] = "add"
        else:
            self.policy.add(block)
        return evicted

    def hit(self, key: bytes) -> None:
        block = self.blocks.get(key)
        if block is None:
            return
        self.policy.on_hit(block, next(self.clock))
        if key not in self.held:
            self.policy.remove(block)
        block.num_hits += 1
        block.last_used = next(self.clock)
        if key in self.held:
            self.held[key] = "add"
        else:
            self.policy.add(block)

    def drop(self, key: bytes) -> None:
        if self.held.pop(key, None) is None:
            self.policy.remove(self.blocks[key])
        del self.blocks[key]

    def evict(self, wanted: bool) -> bytes | None:
        if self.applied is not self.demand:
            for key, how in self.held.items():
                (self.policy.add if how == "add" else self.policy.restore)(self.blocks[key])
            self.held, self.applied = {}, self.demand
            for key in self.demand:
                if key in self.blocks:
                    self.policy.remove(self.blocks[key])
                    self.held[key] = "restore"
        if len(self.policy):
            key = self.policy.pop().block_hash
        elif not wanted:
            return None
        else:
            key = max(self.held, key=lambda k: (self.applied[k], -self.blocks[k].last_used))
            del self.held[key]
        del self.blocks[key]
        return key


OPS = st.lists(st.one_of(
    *[st.tuples(st.just("put"), st.sampled_from(KEYS))] * 3,
    *[st.tuples(st.just("get"), st.sampled_from(KEYS))] * 3,
    st.tuples(st.just("reserve"), st.sampled_from(KEYS), st.booleans()),
    st.tuples(st.just("corrupt"), st.sampled_from(KEYS)),
    st.tuples(st.just("demand"), st.dictionaries(st.sampled_from(KEYS), st.tuples(st.integers(0, 3),
                                                                                   st.integers(0, 3)), max_size=4)),
), min_size=10, max_size=60)


def run_on_tier(cpu: CPUTier, ops, on_put, on_hit, on_drop, on_demand) -> None:
    """Apply ``ops`` to ``cpu`` (real bytes) and to a reference through the callbacks, checking
    after each that both evicted the same keys and hold the same ones."""
    seen = Evictions()
    cpu.add_eviction_listener(seen)
    expected: list[bytes] = []
    stored: set[bytes] = set()
    for op in ops:
        kind, key = op[0], op[1]
        if kind in ("put", "reserve"):
            wanted = op[2] if kind == "reserve" else True
            evicted = on_put(key, wanted)
            if kind == "put":
                assert cpu.put(key, payload(key))
            else:
                got = cpu.reserve(key, PAYLOAD, evict_wanted=wanted)
                if key in stored:
                    assert got is None
                    assert cpu.touch(key)  # as ``TierIO`` reports a key stored already: a use
                elif evicted is None:
                    assert got is False
                else:
                    slot, view = got
                    view[:] = payload(key)
                    cpu.commit(key, slot)
            if evicted is not None:
                expected += evicted
                stored = (stored - set(evicted)) | {key}
        elif kind == "get":
            data = cpu.get(key)
            assert (data is not None) == (key in stored)
            if data is not None:
                assert bytes(data) == payload(key)
                on_hit(key)
        elif kind == "corrupt":
            if key in stored:
                cpu.corrupt(key)  # a hit, then the bytes change
                assert cpu.get(key) is None  # a hit that fails its checksum: dropped
                on_hit(key)
                on_hit(key)
                on_drop(key)
                stored.discard(key)
        else:
            cpu.set_demand(key)
            on_demand(key)
        assert seen.keys == expected
        assert {k for k in KEYS if cpu.contains(k)} == stored


@pytest.mark.parametrize("policy", online_policies())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_cpu_tier_evicts_in_the_policy_objects_own_order(policy, ops):
    """Puts, reserved stores (some that may not evict a wanted key), hits, checksum failures and
    demands on a four-slot CPU tier evict exactly what the policy, driven alone, evicts."""
    ref = PolicyOrder(policy, SLOTS)
    cpu = CPUTier(SLOTS * SLOT, eviction_policy=policy)

    def demand(d):
        ref.demand = d

    run_on_tier(cpu, ops, ref.put, ref.hit, ref.drop, demand)
    assert cpu.arena is None or cpu.arena.policy.name == policy
    learned = getattr(ref.policy, "estimator", None)  # ``reuse`` learns from hits (``on_hit``) and evictions
    if learned is not None and cpu.arena is not None:
        assert (cpu.arena.policy.estimator.hits, cpu.arena.policy.estimator.evictions) == (
            learned.hits, learned.evictions)


class Recorder:
    """The simulated tier's evictions (a ``BlockPoolListener`` of its pool)."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def block_cached(self, group, block, adopted) -> None:
        pass

    def block_evicting(self, group, block) -> None:
        self.keys.append(block.block_hash)


@pytest.mark.parametrize("policy", online_policies())
@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "get"]), st.sampled_from(KEYS)), min_size=5, max_size=60))
def test_cpu_tier_evicts_like_the_simulated_tier(policy, ops):
    """Stores of new blocks and single-block hits: the engine's CPU tier and the simulator's
    ``SimTier`` (a ``BlockPool`` over the same policy class) evict the same keys in the same order."""
    sim = SimTier(SimTierConfig(SLOTS, policy), block_size=16, block_bytes=1.0)
    recorder = Recorder()
    sim.pool.add_listener(recorder)

    def put(key, wanted):  # a store of a stored key is a hit in both
        before = len(recorder.keys)
        sim.store(KVBlock(0, block_hash=key))
        return recorder.keys[before:]

    def hit(key):
        assert sim.load([key], 0.0)[0] == 1

    run_on_tier(CPUTier(SLOTS * SLOT, eviction_policy=policy), ops, put, hit, None, None)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, explicit=st.booleans())
def test_default_lru_evicts_as_a_plain_lru_list(ops, explicit):
    """The default (and ``lru``) is an LRU list in which a store (of a new key or of one stored
    already) or a hit moves a key to the end; the least recently used key no waiting request
    wants goes first, else the wanted key with the largest (rank, depth), least recently used
    first among equals."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    demand: dict = {}

    def put(key, wanted):
        if key in lru:
            lru.move_to_end(key)
            return []
        evicted = []
        if len(lru) == SLOTS:
            free = [k for k in lru if k not in demand]
            if free:
                victim = free[0]
            elif not wanted:
                return None
            else:
                best = max(demand[k] for k in lru)
                victim = next(k for k in lru if demand[k] == best)
            del lru[victim]
            evicted.append(victim)
        lru[key] = None
        return evicted

    def set_demand(d):
        demand.clear()
        demand.update(d)

    cpu = CPUTier(SLOTS * SLOT, eviction_policy="lru") if explicit else CPUTier(SLOTS * SLOT)
    run_on_tier(cpu, ops, put, lambda k: lru.move_to_end(k), lambda k: lru.pop(k), set_demand)


def test_tier_eviction_policy_is_validated_and_reaches_the_flags():
    from kvos.config import EngineConfig
    from kvos.sim import sim_cli

    with pytest.raises(ValueError, match="tier_eviction_policy"):
        EngineConfig(tier_eviction_policy="belady")  # offline: needs the simulator's oracle
    with pytest.raises(ValueError, match="eviction_policy"):
        CPUTier(SLOT, eviction_policy="nope")
    import argparse

    p = argparse.ArgumentParser()
    sim_cli.add_args(p)
    for flag in ("--tier-policy", "--tier-eviction-policy"):  # one field, both spellings, engine and simulator
        a = p.parse_args(["--synthetic", "--tier-blocks", "8", flag, "s3fifo"])
        cfg, _ = sim_cli.build(a)
        assert cfg.tier.policy == "s3fifo"


def chat_with_fresh_fillers(llm) -> list:
    """``test_tiers.chat_turns``, each turn followed by two fillers of its own (text no later
    request repeats): they push the conversation off the 24-block device and fill the tier with
    blocks stored once and never hit, so the tier must evict."""
    from kvos import SamplingParams
    from tests.connector.test_tiers import QUESTIONS, SP, SYSTEM

    msgs = [{"role": "system", "content": SYSTEM}]
    outs = []
    for turn, q in enumerate(QUESTIONS):
        msgs = msgs + [{"role": "user", "content": q}]
        o = llm.chat(msgs, SP, use_tqdm=False)[0]
        outs.append(o)
        msgs = msgs + [{"role": "assistant", "content": o.outputs[0].text}]
        for i in range(2):
            llm.generate([f"unrelated filler text {2 * turn + i} " * 60], SamplingParams(max_tokens=1),
                         use_tqdm=False)
    return outs


@pytest.mark.slow
def test_engine_with_an_s3fifo_tier_serves_prefixes_with_unchanged_output(make_llm):
    """A 24-block device over a CPU tier of 48 slots run by ``s3fifo``: a later turn loads its
    prefix from the tier after the fillers pushed it off the device, the tier evicts, and the
    outputs equal an engine without any cache."""
    from tests.connector.test_tiers import chat_turns

    plain = make_llm(enable_prefix_caching=False)
    reference = [o.outputs[0].token_ids for o in chat_turns(plain, evict=False)]
    slot = -(-(plain.engine.runner.block_bytes + 64) // 64) * 64  # payload, header and alignment
    llm = make_llm(num_blocks=24, cpu_cache_gb=48.5 * slot / (1 << 30), tier_eviction_policy="s3fifo")
    cpu = next(t for t in llm.engine.offload.h.tiers if t.name == "cpu")
    assert cpu.eviction_policy == "s3fifo", "EngineConfig.tier_eviction_policy does not reach build_hierarchy"
    outs = chat_with_fresh_fillers(llm)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert cpu.arena.policy.name == "s3fifo" and cpu.arena.capacity_slots == 48
    # each later turn loads the earlier turns' prompt from the tier: the conversation, used again,
    # reached S3-FIFO's main queue; the fillers' chains, never used again, leave from the small one
    assert [o.metrics["cached_tokens_by_source"].get("cpu", 0) >= 96 for o in outs] == [False, True, True]
    # the loads were heard (``TierIO.fetch`` -> ``note_hits``): the first turn's blocks, loaded twice
    keys = cpu.arena.keys
    assert sorted((keys.num_hits(k) for k in keys), reverse=True)[:6] == [2] * 6
    assert all(o.metrics["cached_tokens_by_source"].get("device", 0) == 0 for o in outs[1:])  # the device lost it
    assert cpu.stats.evictions > 0


CHAIN_KEYS = [bytes([16 + i]) * 16 for i in range(12)]
"""Three chains of four blocks: chain c is keys 4c .. 4c + 3, each block's parent the one before."""


def chain(c: int, n: int) -> list[tuple[bytes, bytes | None]]:
    keys = CHAIN_KEYS[4 * c: 4 * c + n]
    return [(k, keys[i - 1] if i else None) for i, k in enumerate(keys)]


def store_batch_like_tier_io(cpu: CPUTier, blocks: list[tuple[bytes, bytes | None]]) -> None:
    """``TierIO.store_computed``'s protocol for a step's blocks: ``expect`` them, reserve every
    slot (the first of a round may evict a wanted key), fill them, then commit them in order;
    a key stored already ends the round and is touched (a use) after its blocks are bound."""
    cpu.expect([k for k, _ in blocks])
    todo = list(blocks)
    while todo:
        reserved, rest = [], []
        for n, (key, parent) in enumerate(todo):
            if cpu.contains(key):
                if reserved:
                    rest = todo[n:]
                    break
                cpu.touch(key)
                continue
            got = cpu.reserve(key, PAYLOAD, evict_wanted=not reserved)
            if got is False:
                rest = todo[n:]
                break
            if got is not None:
                got[1][:] = payload(key)
                reserved.append((key, parent, got[0]))
        for key, parent, slot in reserved:
            cpu.commit(key, slot, parent=parent)
        todo = rest


def load_like_tier_io(cpu: CPUTier, keys: list[bytes]) -> int:
    """``TierIO.fetch``'s protocol: the leading keys found with ``get_for_load``, then one
    ``note_hits`` for them."""
    found = []
    for key in keys:
        got = cpu.get_for_load(key)
        if got is None:
            break
        assert bytes(got[0]) == payload(key)
        found.append(key)
    cpu.note_hits(found)
    return len(found)


@pytest.mark.parametrize("policy", online_policies())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["batch", "batch", "put", "load"]), st.integers(0, 2),
                              st.integers(1, 4)), min_size=3, max_size=30))
def test_chain_stores_and_loads_are_evicted_like_the_simulated_tier(policy, ops):
    """A step's blocks stored as one batch (``TierIO``'s reserve-all-then-commit, with
    ``expect``), blocks stored one at a time (write-back) and chain loads (``get_for_load``
    then ``note_hits``) on a 6-slot CPU tier, against the simulated tier (``store_batch``,
    ``store``, ``load``): both evict the same keys in the same order, and hold the same keys.
    Chains are stored root first, each block naming its parent."""
    slots = 6
    sim = SimTier(SimTierConfig(slots, policy), block_size=16, block_bytes=1.0)
    recorder = Recorder()
    sim.pool.add_listener(recorder)
    cpu = CPUTier(slots * SLOT, eviction_policy=policy)
    seen = Evictions()
    cpu.add_eviction_listener(seen)
    for kind, c, n in ops:
        blocks = chain(c, n)
        if kind == "batch":
            sim.store_batch([KVBlock(0, block_hash=k, parent_hash=p) for k, p in blocks])
            store_batch_like_tier_io(cpu, blocks)
        elif kind == "put":
            for key, parent in blocks:
                sim.store(KVBlock(0, block_hash=key, parent_hash=parent))
                assert cpu.put(key, payload(key), parent=parent)
        else:
            keys = [k for k, _ in blocks]
            assert load_like_tier_io(cpu, keys) == sim.load(keys, 0.0)[0]
        assert seen.keys == recorder.keys
        assert {k for k in CHAIN_KEYS if cpu.contains(k)} == {k for k in CHAIN_KEYS if sim.lookup(None, [k])}


class ChainGuard:
    """Fails if the tier evicts a key while a key naming it as parent is stored."""

    def __init__(self, parents: dict) -> None:
        self.parents = parents

    def frame_evicted(self, tier, key, frame) -> None:
        assert not any(p == key and tier.contains(k) for k, p in self.parents.items()), "a chain was cut"


@pytest.mark.parametrize("policy", online_policies())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "store", "hit", "demand"]), st.integers(0, 2),
                              st.integers(1, 4)), min_size=5, max_size=50))
def test_the_tier_never_cuts_a_chain_before_its_tail(policy, ops):
    """Whatever the stores, hits and demand: a block leaves the tier only after every stored
    block that extends it (a prefix lookup stops at the first missing block, so a kept tail
    behind a dropped head would be dead weight)."""
    parents = {k: p for c in range(3) for k, p in chain(c, 4)}
    cpu = CPUTier(6 * SLOT, eviction_policy=policy)
    cpu.add_eviction_listener(ChainGuard(parents))
    for kind, c, n in ops:
        if kind == "store":
            for key, parent in chain(c, n):
                assert cpu.put(key, payload(key), parent=parent)
        elif kind == "hit":
            for key, _ in chain(c, n):
                if cpu.get(key) is None:
                    break
        else:
            cpu.set_demand({key: (c, depth) for depth, (key, _) in enumerate(chain(c, n))})


@pytest.mark.parametrize("block_pool", [False, True], ids=["cpu-tier", "block-pool"])
def test_s3fifo_never_promotes_a_chain_head_that_was_never_used_again(block_pool):
    """S3-FIFO promotes a block from the small queue only if it was used after it was cached.
    A two-block chain, stored (or cached and freed) once and never hit, then a scan of one-block
    chains: the chain's head leaves with the scan, though it re-entered the policy when its
    tail went (a re-offer is no use). The engine's CPU tier, and ``BlockPool`` (the device's and
    the simulated tier's)."""
    scan = [bytes([100 + i]) * 16 for i in range(20)]
    head, tail = KEYS[0], KEYS[1]
    if not block_pool:
        cpu = CPUTier(6 * SLOT, eviction_policy="s3fifo")
        assert cpu.put(head, payload(head)) and cpu.put(tail, payload(tail), parent=head)
        for key in scan:
            assert cpu.put(key, payload(key))
        assert not cpu.contains(head) and not cpu.contains(tail)
        return
    sim = SimTier(SimTierConfig(6, "s3fifo"), block_size=16, block_bytes=1.0)
    sim.store(KVBlock(0, block_hash=head))
    sim.store(KVBlock(0, block_hash=tail, parent_hash=head))
    for key in scan:
        sim.store(KVBlock(0, block_hash=key))
    assert not sim.lookup(None, [head])
