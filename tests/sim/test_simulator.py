"""The simulator replays traces through the engine's own scheduler and KV memory system."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvos import SamplingParams
from kvos.config import EngineConfig
from kvos.sim.cost_model import CostModel
from kvos.sim.hardware import GPUS
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SimConfig, Simulator
from kvos.sim.tier import SimTierConfig
from kvos.sim.traces import TraceRequest, load_mooncake, synthetic

pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[1] / "data"
COST = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])


TRACE_ENGINE = {"max_num_batched_tokens": 8192, "max_num_seqs": 256}
"""The engine settings these tests' figures were computed with (the simulator's defaults are
EngineConfig's)."""


TRACE_FLAGS = ("--max-num-batched-tokens", "8192", "--max-num-seqs", "256")


def sim_config(**kw) -> SimConfig:
    return SimConfig.of(**{**TRACE_ENGINE, **kw})


def simulate(trace, **kw) -> dict:
    return Simulator(trace, sim_config(**kw), COST).run()


@pytest.fixture(scope="module")
def conversation():
    return load_mooncake(DATA / "mooncake_conversation.jsonl.gz")


def short_outputs(trace, max_tokens: int) -> list[TraceRequest]:
    """The trace with each request's output cut to ``max_tokens``: hits and evictions come from
    the prompts' blocks (a conversation request's prompt is ~27 blocks of 512, its output under
    one), while the outputs' decode steps make up most of the simulator's steps."""
    return [dataclasses.replace(t, output_len=min(t.output_len, max_tokens)) for t in trace]


def full_block_hit_rate(trace) -> float:
    """Independent of kvos: with an unbounded cache of full blocks, each request hits its
    leading full blocks that an earlier request held in full; over all its ``hash_ids`` (a
    trailing partial block is never cached, whatever the trace's ids say)."""
    seen: set[int] = set()
    hit = total = 0
    for tr in sorted(trace, key=lambda r: r.arrival_s):
        n_full = tr.input_len // 512
        k = 0
        while k < n_full and tr.hash_ids[k] in seen:
            k += 1
        hit, total = hit + k, total + len(tr.hash_ids)
        seen.update(tr.hash_ids[:n_full])
    return hit / total


@pytest.mark.parametrize("name, trace_rate, token_rate", [
    ("synthetic", 0.640, 0.651),
    ("conversation", 0.366, 0.374),
])
def test_mooncake_unbounded_hit_rates(name, trace_rate, token_rate, conversation):
    """The whole trace, each request cut to one output token: the traces' hit rates count prompt
    blocks only, and an unbounded cache keeps every block whatever the outputs hold (decoding
    all 4.1 million output tokens of the conversation trace took 80 s of the suite)."""
    trace = conversation if name == "conversation" else load_mooncake(DATA / f"mooncake_{name}.jsonl.gz")
    trace = [dataclasses.replace(t, output_len=1) for t in trace]
    r = simulate(trace, block_size=512)
    assert r["num_requests"] == len(trace)
    # the traces' own figures count trailing partial blocks too; the cache serves full ones only
    assert abs(r["block_hit_rate"] - full_block_hit_rate(trace)) < 0.0005
    assert r["block_hit_rate"] <= trace_rate + 0.0005
    # kvos caches only full blocks, so hits on trailing partial blocks (<0.1 pp) are not counted
    assert abs(r["token_hit_rate"] - token_rate) < 0.001
    assert r["evictions"] == 0 and r["preemptions"] == 0


def test_lru_below_belady_and_both_rise_with_size(conversation):
    """Plain LRU stays under the optimum; the lookahead lifts LRU toward it, never past it.
    (Outputs cut to 16 tokens, so the sizes are 600 and 2000 blocks: rates 0.037 < 0.045 < 0.075
    and 0.045 < 0.068 < 0.171.)"""
    trace = short_outputs(conversation[:600], 16)
    rates = {(p, la): [simulate(trace, block_size=512, num_blocks=n, eviction_policy=p, max_num_seqs=64,
                                eviction_lookahead=la)["token_hit_rate"] for n in (600, 2000)]
             for p, la in (("lru", 0), ("lru", 256), ("belady", 0))}
    for p, rs in rates.items():
        assert rs == sorted(rs) and rs[0] < rs[-1], (p, rs)
    for lru, lookahead, belady in zip(rates["lru", 0], rates["lru", 256], rates["belady", 0]):
        assert lru < lookahead <= belady


def test_other_policies_run_and_account(conversation):
    for policy in ("fifo", "lfu"):
        r = simulate(short_outputs(conversation[:800], 16), block_size=512, num_blocks=500, eviction_policy=policy)
        assert r["evictions"] > 0 and 0 < r["token_hit_rate"] < 0.5


def test_paged_utilisation_high_contiguous_like_early_systems():
    trace = synthetic(300, rate=6, input_len=(16, 1024), output_len=(16, 512), seed=1)
    paged = simulate(trace, block_size=16)
    contiguous = simulate(trace, block_size=16, allocator="contiguous", max_model_len=2048)
    assert paged["kv_utilization"] >= 0.96
    assert 0.20 <= contiguous["kv_utilization"] <= 0.40
    assert contiguous["token_hit_rate"] == 0.0


def test_lpm_scheduling_and_shared_system_prompts():
    trace = synthetic(200, rate=50, input_len=(32, 256), output_len=(8, 32), system_prompt_len=512,
                      num_system_prompts=4, seed=2)
    fcfs = simulate(trace, block_size=16, num_blocks=600, max_num_seqs=8)
    lpm = simulate(trace, block_size=16, num_blocks=600, max_num_seqs=8, scheduling_policy="lpm")
    assert fcfs["token_hit_rate"] > 0.3 and lpm["token_hit_rate"] >= fcfs["token_hit_rate"]


def test_simulator_and_engine_make_the_same_decisions(make_llm, tokenizer):
    """Same scheduler, same KV memory system: identical per-step batches and hit tokens."""
    prompts = [tokenizer("Shared instructions: answer in one word. " * 6 + f"Question {i}: colour of {c}?").input_ids
               for i, c in enumerate(["sky", "grass", "snow", "coal", "sun", "blood"])]
    outs = [5, 9, 3, 12, 7, 4]
    engine_cfg = dict(block_size=16, num_blocks=30, max_num_batched_tokens=64, max_num_seqs=4)
    llm = make_llm(**engine_cfg)
    eng = llm.engine
    engine_steps: list = []
    eng.schedule_hook = lambda out: engine_steps.append([(s.request.request_id, s.start, s.num_new_tokens)
                                                         for s in out.seqs])
    for i, (p, n) in enumerate(zip(prompts, outs)):
        eng.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0),
                        request_id=str(i))
    cached = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
    trace = [TraceRequest(0.0, len(p), n) for p, n in zip(prompts, outs)]
    sim = Simulator(trace, sim_config(block_size=16, num_blocks=30, max_num_batched_tokens=64, max_num_seqs=4),
                    COST)
    # the simulator's synthetic prompts would hash differently: give it the real token ids
    for tr, p in zip(sim.trace, prompts):
        tr.segments = [(t, 1) for t in p]
    sim_steps: list = []
    sim.schedule_hook = lambda out: sim_steps.append([(s.request.request_id, s.start, s.num_new_tokens)
                                                      for s in out.seqs])
    sim.run()
    assert sim_steps == engine_steps
    assert sim.kv.counters.prefix_hits_tokens == eng.kv.counters.prefix_hits_tokens > 0
    assert sim.kv.counters.preemptions == eng.kv.counters.preemptions


def test_cli_json_and_sweep_plot(tmp_path):
    def kvos(*args):
        r = subprocess.run([sys.executable, "-m", "kvos.cli", *args], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = json.loads(kvos("simulate", "--trace", str(DATA / "mooncake_synthetic.jsonl.gz"), "--limit", "100",
                          "--block-size", "512", "--cache-blocks", "unlimited", "--json", *TRACE_FLAGS))
    for key in ("block_hit_rate", "token_hit_rate", "num_requests", "ttft_p50_s", "throughput_tok_s", "kv_utilization"):
        assert key in out
    assert out["num_requests"] == 100
    kvos("simulate", "--trace", str(DATA / "mooncake_conversation.jsonl.gz"), "--limit", "100",
         "--block-size", "512", "--sweep", "cache-size", "--sweep-sizes", "64", "256", "--sweep-policies", "lru",
         "belady", "--plot-dir", str(tmp_path), *TRACE_FLAGS)
    for png in ("hit_rate_vs_cache_size.png", "ttft_cdf.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert "examples:" in kvos("simulate", "--help") and "examples:" in kvos("plan", "--help")


def test_bad_simulate_input():
    r = subprocess.run([sys.executable, "-m", "kvos.cli", "simulate", "--synthetic", "--cache-blocks", "lots"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cache_blocks" in r.stderr
    with pytest.raises(ValueError, match="allocator"):
        SimConfig.of(allocator="buddy")
    with pytest.raises(TypeError, match="no setting"):
        SimConfig.of(num_gpus=2)
    assert SimConfig().replace(block_size=32).block_size == 32
    assert SimConfig().max_num_seqs == EngineConfig().max_num_seqs  # one default: the engine's


def test_cost_model_calibration_recovers_measured_scales(tmp_path):
    truth = dataclasses.replace(COST, mem_scale=1.3, compute_scale=1.7)
    steps = [{"num_tokens": n, "context_tokens": c, "attn_pairs": n * c,
              "seconds": truth.step_time(n, c, n * c)} for n, c in [(1, 100), (64, 64 * 2000), (8192, 8192),
                                                                    (4096, 20000), (16, 16 * 8000), (2048, 2048)]]
    (tmp_path / "steps.json").write_text(json.dumps({"steps": steps}))
    fitted = dataclasses.replace(COST)
    fitted.calibrate(tmp_path / "steps.json")
    assert fitted.mem_scale == pytest.approx(1.3, rel=1e-6)
    assert fitted.compute_scale == pytest.approx(1.7, rel=1e-6)


def test_lengths_json_and_multi_turn_sessions(tmp_path):
    from kvos.sim.traces import load_lengths_json

    (tmp_path / "lengths.json").write_text(json.dumps([{"input_length": 100 + i, "output_length": 20} for i in range(50)]))
    r = simulate(load_lengths_json(tmp_path / "lengths.json", rate=10), block_size=16)
    assert r["num_requests"] == 50 and r["token_hit_rate"] == 0.0
    sessions = synthetic(120, rate=2, input_len=(64, 128), output_len=(16, 32), turns=4, seed=3)
    r = simulate(sessions, block_size=16)
    assert r["token_hit_rate"] > 0.4  # later turns reuse the earlier turns' prompts


def test_calibrating_on_measured_cpu_steps_predicts_them(llm, tmp_path):
    """Real steps of the default model on this CPU calibrate the cost model: afterwards it
    reproduces the measured total exactly (arithmetic on measured data, no speed assertion)."""
    import random

    from kvos.bench.steps import measure
    from kvos.sim.hardware import GPU

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 300))] for _ in range(6)]
    steps = measure(llm, prompts, max_tokens=8)
    (tmp_path / "steps.json").write_text(json.dumps({"steps": steps}))
    cpu = GPU("2-core CPU", 24 << 30, 10e9, 300e9)  # rough figures; the fit corrects them
    model_before = CostModel.for_model(PRESETS["smollm2-135m"], cpu, weight_dtype="fp32", kv_dtype="fp32")
    assert (model_before.mem_scale, model_before.compute_scale) == (1.0, 1.0)
    model = CostModel.for_model(PRESETS["smollm2-135m"], cpu, weight_dtype="fp32", kv_dtype="fp32")
    model.calibrate(tmp_path / "steps.json")
    predicted = sum(model.step_time(s["num_tokens"], s["context_tokens"], s["attn_pairs"]) for s in steps)
    measured = sum(s["seconds"] for s in steps)
    assert predicted == pytest.approx(measured, rel=1e-6)
    assert model.mem_scale > 0 and model.compute_scale > 0
    assert any(s["num_tokens"] > 100 for s in steps) and any(s["num_tokens"] < 10 for s in steps)


def kvos_main(capsys, *args: str) -> tuple[int, str, str]:
    from kvos.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


HYBRID = ("simulate", "--synthetic", "--model", "gemma-3-270m", "--gpu", "L4", "--cache-gb", "0.25",
          "--max-num-batched-tokens", "1024", "--max-num-seqs", "256", "--json")


def test_hybrid_unified_layout_admits_more_than_homogeneous(capsys):
    """Gemma 3 270M (15 of 18 layers slide over 512 tokens), a burst of 1-3K-token prompts, the
    same 0.25 GiB of KV: the unified layout keeps only the window in sliding layers, so it runs
    about twice the requests at once, preempts less and finishes sooner; same hit rate (none)."""
    work = ("--num-requests", "40", "--rate", "1000", "--input-len", "1024:3072", "--output-len", "128:256")
    runs = {}
    for layout in ("unified", "equal_pages", "homogeneous"):
        rc, out, err = kvos_main(capsys, *HYBRID, *work, "--kv-layout", layout)
        assert rc == 0, err
        runs[layout] = json.loads(out)
    u, e, h = runs["unified"], runs["equal_pages"], runs["homogeneous"]
    assert u["kv_layout"] == "unified" and len(u["kv_groups"]) == 2 and len(u["group_peak_blocks"]) == 2
    assert len(e["kv_groups"]) == 6 and len(h["kv_groups"]) == 1
    # 0.25 GiB: 1092 large pages of 245,760 B (5 full-attention or 1 sliding block each) vs 910 pages
    assert (u["num_blocks"], u["page_bytes"], h["num_blocks"], h["page_bytes"]) == (1092, 245_760, 910, 294_912)
    assert u["running_mean"] > 1.8 * h["running_mean"] and u["running_peak"] > h["running_peak"]
    assert u["preemptions"] < h["preemptions"] and u["makespan_s"] < 0.7 * h["makespan_s"]
    assert u["token_hit_rate"] >= h["token_hit_rate"]
    assert u["num_requests"] == h["num_requests"] == 40 and u["rejected_requests"] == 0
    # KV waste: sliding layers of the homogeneous layout keep every token past the window
    assert u["kv_waste_mean"] < 0.1 and e["kv_waste_mean"] < 0.1 and h["kv_waste_mean"] > 0.5
    assert u["kv_utilization"] > 0.9 > 0.5 > h["kv_utilization"]
    assert max(u["group_peak_blocks"]) <= 1091 * 5 and h["group_peak_blocks"][0] <= 909


def test_hybrid_layouts_agree_on_hits_when_memory_is_ample(capsys):
    """Shared system prompts: with room for everything, every layout serves the same prefix hits
    (a sliding group's hit needs only the window's blocks)."""
    work = ("--num-requests", "60", "--rate", "20", "--input-len", "256:2048", "--output-len", "64:256",
            "--system-prompt-len", "1024", "--num-system-prompts", "4")
    rates = {}
    for layout in ("unified", "homogeneous"):
        rc, out, err = kvos_main(capsys, *HYBRID, *work, "--kv-layout", layout, "--cache-gb", "0.5")
        assert rc == 0, err
        r = json.loads(out)
        rates[layout] = r["token_hit_rate"]
    assert rates["unified"] == rates["homogeneous"] > 0.4


def test_hybrid_unified_hit_rate_under_pressure_with_shared_prompts(capsys):
    """Shared system prompts under memory pressure: the sliding group releases a prefix's window
    blocks as requests pass them, and a plain LRU across groups evicted them while the prefix's
    full-attention blocks stayed referenced (unified 0.31 vs homogeneous 0.42). Sliding groups
    now evict never-hit blocks first, keeping the windows that end shared prefixes."""
    work = ("--num-requests", "60", "--rate", "20", "--input-len", "256:2048", "--output-len", "64:256",
            "--system-prompt-len", "1024", "--num-system-prompts", "4")
    rates = {}
    for layout in ("unified", "homogeneous"):
        rc, out, err = kvos_main(capsys, *HYBRID, *work, "--kv-layout", layout)
        assert rc == 0, err
        rates[layout] = json.loads(out)["token_hit_rate"]
    assert rates["unified"] >= rates["homogeneous"]


def test_hybrid_mooncake_trace_and_text_report(capsys):
    rc, out, err = kvos_main(capsys, "simulate", "--trace", str(DATA / "mooncake_conversation.jsonl.gz"),
                             "--limit", "100", "--block-size", "512", "--model", "gemma-3-270m", "--cache-gb", "1",
                             *TRACE_FLAGS)
    assert rc == 0, err
    assert "unified: full x 3 layers, 5/page; sliding 512 x 15 layers, 1/page" in out
    assert "mean waste" in out and "group peak blocks" in out and "concurrency" in out


def test_hybrid_simulate_errors(capsys):
    base = ("simulate", "--synthetic", "--num-requests", "5", "--model", "gemma-3-270m")
    rc, _, err = kvos_main(capsys, *base, "--eviction-policy", "belady", "--cache-blocks", "100")
    assert rc == 2 and "belady" in err and "single cache group" in err
    rc, _, err = kvos_main(capsys, *base, "--cache-tokens", "10000")
    assert rc == 2 and "cache_tokens" in err
    rc, _, err = kvos_main(capsys, *base, "--allocator", "contiguous")  # the engine's default layout: unified
    assert rc == 2 and "homogeneous" in err
    rc, out, err = kvos_main(capsys, *base, "--allocator", "contiguous", "--kv-layout", "homogeneous",
                             "--max-model-len", "2048", "--json")
    assert rc == 0 and json.loads(out)["kv_layout"] == "homogeneous", err
    # Belady still runs on a single group: the homogeneous layout of the same model
    rc, out, err = kvos_main(capsys, *base, "--kv-layout", "homogeneous", "--eviction-policy", "belady",
                             "--cache-blocks", "100", "--json")
    assert rc == 0 and json.loads(out)["eviction_policy"] == "belady", err


def test_window_pairs_and_windowed_cost():
    from kvos.sim.simulator import window_pairs

    for start, end, w in [(0, 10, 4), (3, 9, 4), (5, 7, 4), (0, 3, 8), (2, 30, 7), (0, 0, 5)]:
        assert window_pairs(start, end, w) == sum(min(p + 1, w) for p in range(start, end))
    gemma = CostModel.for_model(PRESETS["gemma-3-270m"], GPUS["L4"])
    assert (gemma.sliding_window, gemma.sliding_fraction) == (512, 15 / 18)
    dense = gemma.step_time(1, 8192, 8192)
    assert gemma.step_time(1, 8192, 8192, 512, 512) < dense == gemma.step_time(1, 8192, 8192, 8192, 8192)
    assert COST.step_time(1, 8192, 8192, 512, 512) == COST.step_time(1, 8192, 8192)  # no sliding layers


# -- a CPU tier below the device ---------------------------------------------------------------
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_tier_holding_everything_serves_what_an_unbounded_cache_would(conversation, write_policy):
    """A device of 300 blocks (one request at a time) over a tier larger than every block of the
    trace: every prefix computed before is on the device or in the tier, so the hit rate is the
    unbounded cache's, counted independently of kvos."""
    trace = short_outputs(conversation[:300], 1)  # the hit rates count prompt blocks only
    expected = full_block_hit_rate(trace)
    alone = simulate(trace, block_size=512, num_blocks=300, max_num_seqs=1)
    tiered = simulate(trace, block_size=512, num_blocks=300, max_num_seqs=1,
                      tier=SimTierConfig(10_000, write_policy=write_policy))
    assert alone["block_hit_rate"] < expected - 0.02  # the device alone cannot
    assert tiered["block_hit_rate"] == pytest.approx(expected, abs=1e-12)
    assert tiered["tier_loaded_blocks"] > 0 and tiered["tier_evictions"] == 0
    assert 0 < tiered["tier_token_hit_rate"] <= tiered["token_hit_rate"]


def test_tier_load_time_is_bytes_over_the_link_then_the_rest_is_computed():
    """[1,2,3] then [4,5,6] fill a 3-block device; [1,2,7] finds [1,2] only in the tier: its
    TTFT is the copy of two blocks at the tier's bandwidth plus one step computing the rest."""
    bs, n = 512, 3 * 512 - 1  # the prompt and its one output token fit the 3 blocks
    trace = [TraceRequest(0.0, n, 1, [1, 2, 3]), TraceRequest(100.0, n, 1, [4, 5, 6]),
             TraceRequest(200.0, n, 1, [1, 2, 7])]
    tier = SimTierConfig(16, load_bandwidth=20e9)
    r = simulate(trace, block_size=bs, num_blocks=4, max_num_seqs=1, tier=tier)  # + the null block
    load = 2 * bs * COST.kv_bytes_per_token / 20e9
    step = COST.step_time(n - 2 * bs, n, (n - 2 * bs) * (2 * bs + n + 1) // 2)
    assert r["ttft_s"][2] == pytest.approx(load + step, rel=1e-9)
    assert r["tier_loaded_blocks"] == 2 and r["tier_token_hit_rate"] == pytest.approx(2 * bs / (3 * n))
    without = simulate(trace, block_size=bs, num_blocks=4, max_num_seqs=1)
    assert without["token_hit_rate"] == 0 and without["ttft_s"][2] > r["ttft_s"][2]


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_tier_lookahead_keeps_what_a_waiting_request_will_hit(write_policy):
    """All five arrive at once, one runs at a time on a 3-block device over a 4-block tier:
    [1,2,x] leaves blocks 1 and 2 (its third block never fills), [4,5,.], [7,8,.] and [11,12,.]
    bring six more. A plain LRU tier has dropped 1 and 2 by the time [1,2,w] runs, so it hits
    nothing; a tier that knows [1,2,w] is waiting drops the others, and serves it 2 blocks."""
    bs, n = 512, 3 * 512 - 1
    trace = [TraceRequest(0.0, n, 1, ids) for ids in ([1, 2, 3], [4, 5, 6], [7, 8, 9], [11, 12, 13], [1, 2, 10])]
    got = {la: simulate(trace, block_size=bs, num_blocks=4, max_num_seqs=1, eviction_lookahead=0,
                        tier=SimTierConfig(4, write_policy=write_policy, lookahead=la)) for la in (0, 4)}
    assert got[0]["token_hit_rate"] == 0
    assert got[4]["token_hit_rate"] == pytest.approx(2 * bs / (5 * n))
    assert got[4]["tier_loaded_blocks"] == 2


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_no_tier_setting_beats_the_optimum_of_both_memories(data):
    """No device and tier policy pair hits more than Belady on one pool of both sizes."""
    rng_trace = data.draw(st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=4),
                                             st.integers(1, 3)), min_size=2, max_size=12))
    trace, prefixes = [], {}
    for i, (ids, extra) in enumerate(rng_trace):  # chains over a small alphabet: shared prefixes
        chain = prefixes.setdefault(tuple(ids[:1]), ids[:1]) + ids[1:]
        trace.append(TraceRequest(float(i), len(chain) * 512 + extra, 2, chain))
    size = data.draw(st.integers(6, 8))
    tier_blocks = data.draw(st.integers(1, 8))
    opt = simulate(trace, block_size=512, num_blocks=size + tier_blocks, max_num_seqs=1,
                   eviction_policy="belady")
    device = data.draw(st.sampled_from(["lru", "fifo", "lfu", "s3fifo", "arc", "weighted"]))
    cfg = SimTierConfig(tier_blocks, data.draw(st.sampled_from(["lru", "lfu", "s3fifo", "weighted"])),
                        data.draw(st.sampled_from(["write_through", "write_back"])),
                        lookahead=data.draw(st.sampled_from([0, 4])))
    r = simulate(trace, block_size=512, num_blocks=size, max_num_seqs=1, eviction_policy=device,
                 eviction_lookahead=data.draw(st.sampled_from([0, 4])), tier=cfg)
    assert r["token_hit_rate"] <= opt["token_hit_rate"] + 1e-12


def test_a_draft_model_s_kv_group_shares_the_simulated_pool(capsys):
    """1 GiB for Llama-3.1-8B: 512 pages of 2 MiB; with Llama-3.2-1B's draft group (four 512 KiB
    blocks to a page) every request also holds draft blocks, so fewer run at once."""
    work = ("simulate", "--synthetic", "--model", "llama-3.1-8b", "--cache-gb", "1", "--num-requests", "40",
            "--rate", "1000", "--input-len", "512:1024", "--output-len", "32:64", "--json")
    rc, out, err = kvos_main(capsys, *work)
    assert rc == 0, err
    alone = json.loads(out)
    rc, out, err = kvos_main(capsys, *work, "--draft-model", "llama-3.2-1b")
    assert rc == 0, err
    draft = json.loads(out)
    assert draft["num_blocks"] == 512 and draft["page_bytes"] == 2 << 20
    assert [g["role"] for g in draft["kv_groups"]] == ["model", "draft"]
    assert [g["blocks_per_large_page"] for g in draft["kv_groups"]] == [1, 4]
    peak_target, peak_draft = draft["group_peak_blocks"]
    assert peak_target == peak_draft and peak_target + peak_draft / 4 <= 511
    assert draft["running_peak"] < alone["running_peak"]
