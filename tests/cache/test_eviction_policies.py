"""Eviction policies: the offline optimum is an upper bound no online policy beats, the issue's
tie-break case, and the engine's greedy outputs under every policy equal the reference."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvos import LLM, SamplingParams
from kvos.cache.eviction import online_policies
from kvos.sim.cost_model import CostModel
from kvos.sim.hardware import GPUS
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SimConfig, Simulator
from kvos.sim.traces import TraceRequest

POLICIES_UNDER_TEST = online_policies()

COST = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])


def hit_tokens(trace: list[TraceRequest], policy: str, num_blocks: int) -> int:
    cfg = SimConfig.of(block_size=512, num_blocks=num_blocks, eviction_policy=policy, max_num_seqs=1,
                       max_num_batched_tokens=8192)
    r = Simulator(trace, cfg, COST).run()
    return round(r["token_hit_rate"] * sum(t.input_len for t in trace))


def test_optimum_breaks_ties_toward_the_chain_tail():
    """[1,2,3], [4,5,6], [1,2,7] (1,025 tokens each, 4 usable blocks): the second request needs a
    cached block; evicting block 2 (not 1, the chain's head) keeps a 512-token hit for the third."""
    trace = [TraceRequest(i * 10.0, 1025, 1, ids) for i, ids in enumerate([[1, 2, 3], [4, 5, 6], [1, 2, 7]])]
    assert hit_tokens(trace, "belady", 5) == 512
    assert hit_tokens(trace, "lru", 5) == 512


@st.composite
def conversations(draw) -> list[TraceRequest]:
    """Multi-turn sessions over a few shared system prompts: a turn's prompt extends the
    session's previous prompt, as in the Mooncake conversation trace."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    n_sessions, n_requests = rng.randint(2, 6), rng.randint(6, 24)
    next_id = 100
    sessions = []
    for _ in range(n_sessions):
        system = rng.randint(0, 2)
        sessions.append([system * 10 + k for k in range(rng.randint(0, 2))])
    trace = []
    for i in range(n_requests):
        s = rng.randrange(n_sessions)
        grow = rng.randint(1, 3)
        sessions[s] = sessions[s] + list(range(next_id, next_id + grow))
        next_id += grow
        ids = sessions[s]
        trace.append(TraceRequest(float(i), 512 * (len(ids) - 1) + rng.randint(1, 512), rng.randint(1, 40),
                                  list(ids)))
    return trace


@settings(max_examples=40, deadline=None)
@given(trace=conversations(), num_blocks=st.integers(4, 14))
def test_no_policy_beats_the_optimum(trace, num_blocks):
    longest = max(-(-(t.input_len + t.output_len) // 512) for t in trace)
    num_blocks = max(num_blocks, longest + 1)
    best = hit_tokens(trace, "belady", num_blocks)
    for policy in POLICIES_UNDER_TEST:
        assert hit_tokens(trace, policy, num_blocks) <= best, policy


@pytest.fixture(scope="module")
def reference(llm):
    prompts = [f"Question {i}: a train leaves station {i} at {i + 3} o'clock with {7 * i} passengers; how "
               f"many are left after {i + 1} stops? Answer:" for i in range(6)]
    shared = "You are a careful assistant who answers in one short sentence. " * 4
    batch = [shared + p for p in prompts] + prompts[:2]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # evictions come from the prompts
    return batch, params, [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.mark.parametrize("policy", POLICIES_UNDER_TEST)
def test_engine_outputs_unchanged_under_every_policy(make_llm, reference, policy):
    """A pool of 20 blocks of 16 tokens: the prompts cannot all stay cached, so every policy
    evicts; greedy tokens equal the default engine's."""
    batch, params, ref = reference
    llm = make_llm(num_blocks=20, block_size=16, eviction_policy=policy, max_num_seqs=2)
    outs = []
    for i in range(0, len(batch), 2):  # in pairs, so later pairs hit what earlier ones left
        outs += llm.generate(batch[i: i + 2] + batch[:1], params, use_tqdm=False)[:2]
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = llm.engine.kv.counters
    assert stats.evictions > 0 and stats.prefix_hits_tokens > 0


@pytest.mark.parametrize("policy", POLICIES_UNDER_TEST)
@pytest.mark.parametrize("protect", [True, False])
def test_blocks_a_waiting_request_will_hit_are_evicted_last(policy, protect):
    """vLLM RFC #48485's case: a running request needs one cached block evicted while W, next
    in the queue, is about to hit the oldest cached prefix X. LRU alone would evict X's tail;
    with the waiting queue's demand held back, another block goes and W hits all of X."""
    from kvos.cache.kv_manager import KVCacheManager
    from kvos.cache.spec import FullAttentionSpec
    from kvos.core.request import Request
    from kvos.scheduler.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 10, "m", policy=policy)  # 9 usable blocks of 4
    sched = Scheduler(SchedulerConfig(64, 1, eviction_lookahead=8 if protect else 0), kv)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def run(*reqs: Request) -> None:
        for r in reqs:
            sched.add_request(r)
        while sched.has_unfinished():
            out = sched.schedule()
            sched.update_from_output(out, {t.request_id: 7 for s in out.seqs for t in s.samplers})

    x = list(range(100, 108))
    run(Request("X", x + [1], params))  # caches X0, X1
    run(Request("Y", list(range(200, 208)) + [1], params))  # caches Y0, Y1, used after X
    r = Request("R", list(range(300, 322)), params)  # 6 blocks: 5 plain free, one eviction
    w = Request("W", x + [2, 3, 4, 5], params)
    run(r, w)
    assert kv.counters.evictions >= 1
    if protect:
        assert w.num_cached_tokens == 8
    elif policy in ("lru", "fifo", "weighted"):
        assert w.num_cached_tokens == 4  # alone, these evict X's tail (oldest, equal value)


def test_reuse_policy_on_the_engine_hits_more_than_lru_with_the_same_outputs():
    """The engine (a tiny Llama of random weights: the replay runs 320 steps) replays documents of Zipf popularity, each answered at length, one request
    at a time in a pool of 16 blocks of 4 tokens: no prompt repeats an answer, so ``reuse``
    learns that generated blocks are dead and keeps more documents than LRU (the simulator's
    figures for this replay: LRU 26%, reuse 33%, optimum 42% of prompt tokens). Greedy outputs
    are LRU's."""
    rng = random.Random(0)
    docs = [[1000 + 50 * d + i for i in range(12)] for d in range(8)]
    order = [rng.choices(range(8), [1 / (i + 1) for i in range(8)])[0] for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for policy in ("lru", "reuse"):
        llm = LLM(model="llama-tiny", random_weights=True, num_blocks=16, block_size=4, eviction_policy=policy,
                  max_num_seqs=1, eviction_lookahead=0)
        outs = llm.generate([docs[d] for d in order], params, use_tqdm=False)
        results[policy] = ([o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs))
    assert results["reuse"][0] == results["lru"][0]
    assert results["reuse"][1] > results["lru"][1], results
