"""Routing policies, and the fleet simulator that replays a trace across several engines."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvos.cache.hashing import extend_block_hashes, root_hash
from kvos.core.kv_events import BlockRemoved, BlockStored, KVEventBatch
from kvos.router import (
    ROUTERS,
    Approx,
    EngineLoad,
    KVAware,
    LeastLoaded,
    RoundRobin,
    RouterConfig,
    make_router,
)
from kvos.router.policies import (
    DEFAULT_QUEUE_WEIGHT,
    DEFAULT_SHARED_BALANCE,
    DEFAULT_SHARED_THRESHOLD,
    DEFAULT_SOLE_MARGIN,
)
from kvos.sim.cost_model import CostModel
from kvos.sim.fleet import FleetSimulator
from kvos.sim.hardware import GPUS
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SIM_MODEL_ID, EngineSim, SimConfig, Simulator
from kvos.sim.traces import TraceRequest, load_mooncake
from tests.sim.test_simulator import full_block_hit_rate  # independent of kvos

DATA = Path(__file__).parents[1] / "data"
COST = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])


TRACE_ENGINE = {"max_num_batched_tokens": 8192, "max_num_seqs": 256}
"""The engine settings these tests' figures were computed with (the simulator's defaults are
EngineConfig's)."""


def sim_config(**kw) -> SimConfig:
    return SimConfig.of(**{**TRACE_ENGINE, **kw})
IDLE = EngineLoad()


def hashes_of(tokens: list[int], block_size: int = 4, salt: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, block_size, root_hash(SIM_MODEL_ID, salt))
    return out


def stored(engine: int, seq: int, hashes: list[bytes], epoch: str = "e") -> KVEventBatch:
    parents = [b"root", *hashes[:-1]]
    return KVEventBatch(f"engine-{engine}", epoch, seq, tuple(BlockStored(h, p, 4) for h, p in zip(hashes, parents)))


@pytest.fixture(scope="module")
def conversation():
    return load_mooncake(DATA / "mooncake_conversation.jsonl.gz", 600)


# -- the policies, against their definitions ---------------------------------------------
def test_round_robin_takes_live_engines_in_turn():
    r = RoundRobin(3)
    assert [r.choose([], []) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    r.on_engine_removed(2)
    assert [r.choose([], []) for _ in range(4)] == [1, 0, 1, 0]
    assert r.on_engine_added() == 3
    assert [r.choose([], []) for _ in range(3)] == [1, 3, 0]


def test_least_loaded_picks_the_least_load_then_fewest_requests_then_lowest_number():
    r = LeastLoaded(3, block_size=4)
    loads = [EngineLoad(0, 2, 8, 5), EngineLoad(1, 0, 4, 3), EngineLoad(0, 1, 12, 1)]  # 7, 4, 4 blocks
    assert [x.blocks(4) for x in loads] == [7, 4, 4]
    assert r.choose([b"x"], loads) == 1  # 4 blocks and 1 request each: the lower number
    loads[2] = EngineLoad(0, 0, 12, 1)
    assert r.choose([b"x"], loads) == 2  # 4 blocks each, engine 2 has no request
    r.on_engine_removed(2)
    assert r.choose([b"x"], loads) == 1
    r.on_engine_removed(0)
    r.on_engine_removed(1)
    with pytest.raises(RuntimeError, match="no engine"):
        r.choose([b"x"], loads)


def test_kv_aware_prefers_the_longest_cached_prefix_and_trades_it_against_load():
    req = hashes_of(list(range(12)))  # 3 blocks
    other = hashes_of([99] * 8)
    r = KVAware(3, block_size=4, overlap_weight=1.0, sole_margin=0)  # the cost alone
    assert r.on_events(1, stored(1, 1, req))
    assert r.on_events(2, stored(2, 1, req[:1] + other))
    assert [r.predicted_hits(e, req) for e in range(3)] == [0, 3, 1]
    assert r.choose(req, [IDLE] * 3) == 1
    # cost = w * (pending prefill blocks + 3 - hits) + active blocks; engine 1 decodes 4 blocks
    busy1 = [IDLE, EngineLoad(active_blocks=4), IDLE]
    assert [r.cost(e, req, busy1[e]) for e in range(3)] == [3, 4, 2]
    assert r.choose(req, busy1) == 2
    r.overlap_weight = 2.0  # costs 6, 4, 4: the tie goes to the lower load (engine 2's 0 blocks)
    assert r.choose(req, busy1) == 2
    r.overlap_weight = 3.0  # 9, 4, 6
    assert r.choose(req, busy1) == 1
    r.overlap_weight = 0.0  # pure decode balance: 0, 4, 0 -> engine 0 (equal load, lower number)
    assert r.choose(req, busy1) == 0
    # engine 1 holds the prefix behind 4 blocks of pending prefill: Dynamo's cost (queue weight 1)
    # sends the request to idle engine 0 (costs 3, 4, 4); at 0.25 the queue costs 1 and it stays
    r.overlap_weight = 1.0
    queued1 = [IDLE, EngineLoad(prefill_tokens=16), EngineLoad(prefill_tokens=16)]
    r.queue_weight = 1.0
    assert [r.cost(e, req, queued1[e]) for e in range(3)] == [3, 4, 6] and r.choose(req, queued1) == 0
    r.queue_weight = 0.25
    assert [r.cost(e, req, queued1[e]) for e in range(3)] == [3, 1, 3] and r.choose(req, queued1) == 1
    assert KVAware(2).queue_weight == DEFAULT_QUEUE_WEIGHT < 1
    # evicting the first block ends the prefix there
    assert r.on_events(1, KVEventBatch("engine-1", "e", 2, (BlockRemoved(req[0]),)))
    assert r.predicted_hits(1, req) == 0 and r.choose(req, [IDLE] * 3) == 2


def test_kv_aware_balance_guard_leaves_out_engines_loaded_past_both_thresholds():
    req = hashes_of(list(range(12)))
    r = KVAware(3, block_size=4, balance=(8, 1.5))
    assert r.on_events(0, stored(0, 1, req))  # only engine 0 holds the prompt

    def running(*n: int) -> list[EngineLoad]:
        return [EngineLoad(running=x) for x in n]

    assert r.choose(req, running(12, 4, 5)) == 0  # 8 over the least: not more than 8
    assert r.choose(req, running(13, 4, 5)) == 1  # 9 over and 3.25x: left out; 1 and 2 cost the same
    assert r.balanced([0, 1, 2], running(13, 4, 5)) == [1, 2]
    assert r.choose(req, running(30, 21, 40)) == 0  # 9 over 21 but only 1.43x
    assert r.balanced([0, 1, 2], running(30, 21, 40)) == [0, 1]  # 40 is 19 over and 1.9x
    assert r.choose(req, [EngineLoad(waiting=10, running=3), EngineLoad(running=4), IDLE]) == 1  # waiting counts
    r.balance_rel = 0.0  # off: the prompt's blocks win however loaded engine 0 is
    assert r.choose(req, running(100, 0, 0)) == 0
    with pytest.raises(ValueError, match="balance_rel"):
        KVAware(2, balance=(8, 0.5))
    with pytest.raises(ValueError, match="balance_abs"):
        KVAware(2, balance=(-1, 2.0))


def test_shared_prefix_guard_moves_only_shared_prefixes_off_an_engine_over_the_tight_guard():
    """Loose guard 16,3 for every request, tight 8,2 where the cached prefix on the loaded engine
    is shared: its last block in more than T = 3 earlier routed requests."""
    hot = list(range(8))  # a system prompt of 2 blocks
    r = KVAware(3, block_size=4, balance=(16, 3.0), shared_balance=(8, 2.0), shared_threshold=3)
    first = hashes_of(hot + [100] * 4)  # conversation A's first turn: the prompt and 1 block of its own
    follow = hashes_of(hot + [100] * 4 + [101] * 4)  # A's next turn: 3 blocks cached on engine 0
    other = hashes_of(hot + [200] * 4)  # conversation B: only the prompt is cached on engine 0
    assert r.on_events(0, stored(0, 1, first))
    for req in (first, hashes_of(hot + [300] * 4), hashes_of(hot + [301] * 4)):  # 3 requests hold the prompt
        r.on_routed(0, req)
    assert (r.uses[first[1]], r.uses[first[2]], len(r.uses)) == (3, 1, 5)
    loads = [EngineLoad(running=12), EngineLoad(running=2), EngineLoad(running=3)]  # 10 over 2 and 6x:
    assert r.balanced([0, 1, 2], loads) == [0, 1, 2]  # in the loose guard,
    assert r.balanced([0, 1, 2], loads, (8, 2.0)) == [1, 2]  # out of the tight one
    assert r.predicted_hits(0, other) == 2 and not r.shared_prefix(0, other)
    assert r.choose(other, loads) == 0  # the prompt's last block was in 3 requests, not more: it stays
    r.on_routed(0, hashes_of(hot + [302] * 4))  # a 4th: the prompt is shared
    assert r.shared_prefix(0, other) and r.allowed(other, loads) == [1, 2]
    assert r.choose(other, loads) == 1  # moved off engine 0; 1 and 2 cost the same, 1 has the lower number
    # A's own history: its last cached block was in 1 request (its first turn), so it stays
    assert r.predicted_hits(0, follow) == 3 and not r.shared_prefix(0, follow)
    assert r.choose(follow, loads) == 0
    r.shared_threshold = 1
    assert r.choose(follow, loads) == 0 and r.choose(other, loads) == 1
    assert r.choose(follow, [EngineLoad(running=30), EngineLoad(running=2), IDLE]) == 1  # the loose guard still
    off = KVAware(3, block_size=4, balance=(16, 3.0), shared_threshold=0)  # the guard off
    assert off.on_events(0, stored(0, 1, first))
    for k in range(10):
        off.on_routed(0, hashes_of(hot + [300 + k] * 4))
    assert off.choose(other, loads) == 0 and not off.uses  # today's rule, no counts kept
    with pytest.raises(ValueError, match="shared_threshold"):
        KVAware(2, shared_threshold=-1)
    with pytest.raises(ValueError, match="shared_balance: balance_rel"):
        KVAware(2, shared_balance=(8, 0.5))


def test_sole_holder_rule_keeps_a_request_with_the_engine_holding_clearly_more_of_it():
    """With ``sole_margin`` M, the engine holding at least M more leading blocks than every other
    is chosen over a cheaper one (its queue) if both guards leave it in; by cost otherwise."""
    req = hashes_of(list(range(16)))  # 4 blocks
    r = KVAware(3, block_size=4, overlap_weight=64.0, queue_weight=0.1, sole_margin=2)
    assert r.on_events(0, stored(0, 1, req[:3]))  # engine 0 holds 3 blocks, engine 1 one, engine 2 none
    assert r.on_events(1, stored(1, 1, req[:1]))
    loads = [EngineLoad(prefill_tokens=400), IDLE, IDLE]  # 100 queued blocks at 0.1: engine 0 costs 704
    assert [r.cost(e, req, loads[e]) for e in range(3)] == [704, 192, 256]
    assert r.sole_holder(req) == 0 and r.choose(req, loads) == 0  # 3 - 1 >= 2: it stays with its blocks
    r.sole_margin = 3  # 3 - 1 < 3: no sole holder, the cost decides
    assert r.sole_holder(req) is None and r.choose(req, loads) == 1
    r.sole_margin = 2
    busy = [EngineLoad(prefill_tokens=400, running=30), IDLE, IDLE]  # engine 0 out of the balance guard
    assert r.allowed(req, busy) == [1, 2] and r.choose(req, busy) == 1
    assert r.on_events(1, stored(1, 2, req[1:2]))  # engine 1 now holds 2: a lead of 1 is not enough
    assert r.sole_holder(req) is None and r.choose(req, loads) == 1
    r.on_engine_removed(1)  # engine 0 leads engine 2 by 3 among the live ones
    assert r.sole_holder(req) == 0 and r.choose(req, loads) == 0
    assert not r.on_events(2, stored(2, 3, req))  # engine 2 missed a batch: its index is stale
    assert r.sole_holder(req) is None and r.choose(req, loads) == 2  # the rule stands aside; cost (0 hits)
    assert KVAware(2).sole_margin == DEFAULT_SOLE_MARGIN
    with pytest.raises(ValueError, match="sole_margin"):
        KVAware(2, sole_margin=-1)


def test_shared_prefix_counts_stay_within_their_bound():
    """At most ``capacity_blocks`` hashes per engine slot, the least recently routed dropped
    first; a hash routed again is refreshed; a dropped one counts from 0."""
    r = KVAware(2, block_size=4, capacity_blocks=3, shared_threshold=1)
    hot = hashes_of(list(range(4)))
    for k in range(20):
        r.on_routed(k % 2, hot)
        r.on_routed(k % 2, hashes_of([1000 + k] * 8))  # 2 blocks of its own
        assert len(r.uses) <= 6
    assert len(r.uses) == 6 and r.uses[hot[0]] == 20  # the hot block stayed, counted every time
    assert list(r.uses)[-2:] == hashes_of([1019] * 8)  # the most recent last
    assert hashes_of([1000] * 8)[0] not in r.uses
    r.on_routed(0, hashes_of([1000] * 8))  # back, counting from 0
    assert r.uses[hashes_of([1000] * 8)[0]] == 1 and len(r.uses) == 6
    r.on_engine_removed(1)  # counts of requests, not of engines: kept, and the slot still counts
    assert r.uses[hot[0]] == 20 and len(r.uses) == 6
    assert r.on_engine_added() == 2
    for k in range(5):
        r.on_routed(2, hashes_of([3000 + k] * 8))
    assert len(r.uses) == 9


def test_balance_guard_spreads_hot_prefixes_that_first_landed_three_to_one():
    """4 shared system prompts whose first requests land 3 to 1 on two engines (the second
    prompt's first request finds engine 0 idle, the last two find engine 1 busy), then 400
    requests cycling over the 4 prompts, 20 ms apart; pools hold everything. Without the guards
    each prompt stays where it was first computed, and the default loose guard (16,3) alone does
    not move them; with the shared-prefix guard (8,2 where the prompt was in more than 8
    requests, the defaults) the loaded engine's prompts get a copy on the other, for one prefill each."""
    firsts = [TraceRequest(t, 416, 64, segments=[(i, 384), (1000 + i, 32)]) for i, t in enumerate([0, 1.0, 1.2, 1.25])]
    rest = [TraceRequest(2.5 + 0.02 * k, 416, 64, segments=[(k % 4, 384), (2000 + k, 32)]) for k in range(400)]
    cfg = sim_config(block_size=16, num_blocks=None)
    off = FleetSimulator(firsts + rest, cfg, COST, 2,
                         RouterConfig("kv_aware", router_balance=(8, 0.0), router_shared_threshold=0)).run()
    loose = FleetSimulator(firsts + rest, cfg, COST, 2, RouterConfig("kv_aware", router_shared_threshold=0)).run()
    on = FleetSimulator(firsts + rest, cfg, COST, 2, "kv_aware").run()
    assert off["requests_per_engine"] == loose["requests_per_engine"] == [303, 101]  # the case the guard is for
    assert on["shared_threshold"] == DEFAULT_SHARED_THRESHOLD > 0 and on["imbalance_requests"] <= 1.05
    bound = len(rest) * 24 / (len(firsts + rest) * 26)  # one unbounded cache: 24 of 26 blocks after each first
    assert on["block_hit_rate"] >= off["block_hit_rate"] - 0.005 and on["block_hit_rate"] <= bound + 1e-9


def test_kv_aware_marks_a_gap_stale_until_a_snapshot():
    req = hashes_of(list(range(8)))
    r = KVAware(2, block_size=4)
    assert r.on_events(0, stored(0, 1, req))
    assert not r.on_events(0, stored(0, 3, req))  # batch 2 was missed
    assert r.predicted_hits(0, req) == 0
    assert not r.on_events(0, stored(0, 4, req))  # still stale
    from kvos.core.kv_events import KVSnapshot

    r.on_snapshot(0, KVSnapshot("engine-0", "e", 4, (frozenset(req[:1]),)))
    assert r.predicted_hits(0, req) == 1
    assert r.on_events(0, stored(0, 5, req[1:]))
    assert r.predicted_hits(0, req) == 2


def test_tenants_keep_their_salts_across_engines():
    tokens = list(range(8))
    r = KVAware(2, block_size=4)
    r.on_events(1, stored(1, 1, hashes_of(tokens, salt="tenant-a")))
    assert r.predicted_hits(1, hashes_of(tokens, salt="tenant-a")) == 2
    assert r.predicted_hits(1, hashes_of(tokens, salt="tenant-b")) == 0
    assert r.predicted_hits(1, hashes_of(tokens)) == 0


def test_approx_remembers_what_it_sent_and_forgets_the_oldest():
    a, b = hashes_of(list(range(8))), hashes_of([50 + i for i in range(12)])
    r = Approx(2, block_size=4, capacity_blocks=4)
    assert r.choose(a, [IDLE, IDLE]) == 0  # knows nothing: equal costs, lower number
    r.on_routed(1, a)
    assert r.predicted_hits(1, a) == 2 and r.choose(a, [IDLE, IDLE]) == 1
    r.on_routed(1, b)  # 5 distinct blocks sent to engine 1: a's first one falls out
    assert len(r.sent[1]) == 4 and r.predicted_hits(1, a) == 0 and r.predicted_hits(1, b) == 3
    r.on_routed(1, a)  # sending a again refreshes it; b's first block falls out
    assert r.predicted_hits(1, a) == 2 and r.predicted_hits(1, b) == 0
    assert not r.uses_events and r.on_events(1, stored(1, 1, b))  # events are ignored
    assert r.predicted_hits(1, b) == 0


def test_make_router():
    assert tuple(ROUTERS) == ("round_robin", "least_loaded", "kv_aware", "approx")
    for name in ROUTERS:
        assert make_router(name, 2).name == name
    assert make_router("kv_aware", 2, overlap_weight=3.0).overlap_weight == 3.0
    assert make_router("approx", 2, capacity_blocks=7).capacity_blocks == 7
    with pytest.raises(ValueError, match="router must be one of"):
        make_router("random", 2)


def test_kv_aware_index_from_events_equals_each_engines_prefix_index(conversation):
    trace = conversation[:200]
    fleet = FleetSimulator(trace, sim_config(block_size=512, num_blocks=200), COST, 3, "kv_aware")
    fleet.run()
    assert any(eng.kv.counters.evictions for eng in fleet.engines)
    for e, eng in enumerate(fleet.engines):
        assert fleet.router.index[e].groups[0] == set(eng.kv.pool.index.hashes())


def test_event_built_index_routes_a_follow_up_to_the_engine_that_served_the_first_turn():
    first = TraceRequest(0.0, 64, 2, segments=[(1, 64)])
    follow = TraceRequest(10.0, 96, 2, segments=[(1, 64), (2, 32)])
    trace = [first, TraceRequest(0.0, 64, 2, segments=[(3, 64)]), follow]
    cfg = sim_config(block_size=16, num_blocks=64)
    for router in ("kv_aware", "approx"):
        fleet = FleetSimulator(trace, cfg, COST, 2, router)
        fleet.run()
        served = {e: sorted(int(r) for r in eng.first) for e, eng in enumerate(fleet.engines)}
        assert served[0] == [0, 2] and served[1] == [1], router
        assert fleet.engines[0].hit_blocks_of[2] == 4


# -- the fleet simulator -----------------------------------------------------------------
def test_one_engine_fleet_replays_exactly_like_the_simulator(conversation):
    trace = conversation[:250]
    cfg = sim_config(block_size=512, num_blocks=300, max_num_seqs=32)
    single = Simulator(trace, cfg, COST).run()
    assert single["evictions"] > 0 and single["preemptions"] > 0
    for router in ("kv_aware", "round_robin"):
        fleet = FleetSimulator(trace, cfg, COST, 1, router).run()
        for key in ("block_hit_rate", "token_hit_rate", "ttft_s", "ttft_p90_s", "tpot_p50_s", "makespan_s", "steps",
                    "preemptions", "evictions"):
            assert fleet[key] == single[key], (router, key)


@pytest.fixture(scope="module")
def four_engines(conversation):
    cfg = sim_config(block_size=512, num_blocks=1000)
    return {name: FleetSimulator(conversation, cfg, COST, 4, name).run() for name in ROUTERS}


def test_kv_aware_hits_more_than_round_robin_and_no_router_beats_one_unbounded_cache(conversation, four_engines):
    bound = full_block_hit_rate(conversation)
    assert bound > 0.15  # the slice's later turns repeat earlier prefixes
    for name, r in four_engines.items():
        assert 0 < r["block_hit_rate"] <= bound + 1e-9, name
    assert four_engines["kv_aware"]["block_hit_rate"] > 1.2 * four_engines["round_robin"]["block_hit_rate"]
    assert four_engines["approx"]["block_hit_rate"] > four_engines["round_robin"]["block_hit_rate"]
    # the event-built index predicts what the engines then hit (within a step's lag)
    kv = four_engines["kv_aware"]
    assert abs(kv["predicted_hit_blocks"] - kv["obtained_hit_blocks"]) <= 0.05 * kv["obtained_hit_blocks"]


def test_every_request_is_served_exactly_once(conversation, four_engines):
    for name, r in four_engines.items():
        assert r["rejected_requests"] == 0
        assert sum(r["requests_per_engine"]) == len(conversation), name
        assert len(r["ttft_s"]) == len(conversation), name
        if name == "round_robin":
            assert r["requests_per_engine"] == [len(conversation) // 4] * 4
        assert 1.0 <= r["imbalance_requests"] <= 4.0


def test_engines_never_share_a_request():
    trace = [TraceRequest(0.01 * i, 40, 3, segments=[(i % 5, 40)]) for i in range(60)]
    fleet = FleetSimulator(trace, sim_config(block_size=16, num_blocks=40), COST, 3, "least_loaded")
    r = fleet.run()
    ids = [set(eng.index_of) for eng in fleet.engines]
    assert sum(len(s) for s in ids) == len(trace) and set().union(*ids) == {str(i) for i in range(len(trace))}
    assert [len(s) for s in ids] == r["requests_per_engine"]


def test_fleet_refuses_belady_and_mismatched_routers():
    trace = [TraceRequest(0.0, 32, 2)]
    with pytest.raises(ValueError, match="belady"):
        FleetSimulator(trace, sim_config(eviction_policy="belady"), COST, 2)
    with pytest.raises(ValueError, match="built for 3 engines"):
        FleetSimulator(trace, sim_config(), COST, 2, KVAware(3))
    with pytest.raises(ValueError, match="block_size"):
        FleetSimulator(trace, sim_config(block_size=16), COST, 2, KVAware(2, block_size=32))


def test_engine_sim_admits_at_arrival_when_idle():
    eng = EngineSim([TraceRequest(5.0, 32, 2)], sim_config(), COST)
    eng.admit(0, at=5.0)
    assert eng.clock == 5.0 and eng.busy()
    while eng.busy():
        eng.step()
    assert eng.first["0"] > 5.0 and eng.done["0"] >= eng.first["0"]


# -- commands ----------------------------------------------------------------------------
def kvos(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvos.cli", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_cli_simulate_two_engines():
    args = ["simulate", "--trace", str(DATA / "mooncake_conversation.jsonl.gz"), "--limit", "120",
            "--block-size", "512", "--cache-blocks", "400", "--engines", "2", "--router", "kv_aware",
            "--max-num-batched-tokens", "8192", "--max-num-seqs", "256"]
    out = json.loads(kvos(*args, "--json", "--kv-weight", "2", "--router-balance", "5,2", "--router-shared-balance",
                          "3,1.5", "--router-shared-threshold", "4"))
    assert out["num_engines"] == 2 and out["router"] == "kv_aware" and out["overlap_weight"] == 2.0
    assert out["balance"] == [5, 2.0] and out["shared_balance"] == [3, 1.5] and out["shared_threshold"] == 4
    bad = subprocess.run([sys.executable, "-m", "kvos.cli", *args, "--router-balance", "5,0.5"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--router-balance" in bad.stderr and "balance_rel must be 0 (off) or >= 1" in bad.stderr
    assert sum(out["requests_per_engine"]) == 120 and 0 < out["block_hit_rate"] < 1
    text = kvos(*args)
    assert "imbalance" in text and "predicted hits" in text


def test_cli_bench_routing(tmp_path):
    out, png = tmp_path / "routing.json", tmp_path / "routing.png"
    kvos("bench", "routing", "--limit", "120", "--engines", "2", "--jobs", "1", "--calibration-requests", "60",
         "--blocks", "300", "--output", str(out), "--plot", str(png))
    report = json.loads(out.read_text())
    assert png.stat().st_size > 0 and report["machine"]
    assert (report["router_shared_balance"], report["router_shared_threshold"]) == (
        list(DEFAULT_SHARED_BALANCE), DEFAULT_SHARED_THRESHOLD)  # the settings it ran with
    rows = report["results"]
    assert {r["label"] for r in rows} == {"one engine, all the memory", "one engine, all the memory and compute",
                                         "round_robin", "least_loaded",
                                         "kv_aware w=1", "kv_aware w=64", "approx w=1", "approx w=64"}
    assert all(r["engines"] == 2 for r in rows)
    summary = report["summary"][0]
    assert summary["engines"] == 2 and "kv_aware w=64 of reference hit" in summary
    assert "kv_aware w=64 of scaled reference hit" in summary
    ref = next(r for r in rows if r["router"] == "one engine, all the memory")
    assert ref["time_scale"] == pytest.approx(2 * report["time_scales"]["2"])
    scaled = next(r for r in rows if r["router"] == "one engine, all the memory and compute")
    assert scaled["time_scale"] == pytest.approx(report["time_scales"]["2"])  # the fleet's own arrivals
    assert scaled["tpot_p50_s"] < 0.75 * ref["tpot_p50_s"]  # twice the compute: simulated steps about half as long
