"""``kvos bench tier-parity``: the engine's CPU tier against the simulator's, one trace, each tier
eviction policy: prompt tokens each serves from the tier, request by request.

The trace tests scan resistance. Three hot system prompts (``--hot-blocks`` blocks each, each
request adding a new one-block question) alternate with cold one-off documents
(``--cold-blocks``), so between two uses of a hot prompt three cold documents pass through the
tier. The device pool (``--device-blocks``) keeps about one request, so every later hit comes
from the CPU tier (``--tier-slots`` slots, write-through). Requests run one at a time, one output
token each. The engine runs the default model on token ids (each content a fixed random token
list); the simulator runs the same trace (``TraceRequest`` segments) with the same settings.

The two tiers run the same policy objects through the same protocol (a step's blocks stored as
one batch, a load's chain heard as one use, a stored block stored again counted as a use), so
they should agree request by request; ``agree`` says whether they did.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

BLOCK_SIZE = 16


def add_args(p: argparse.ArgumentParser) -> None:
    from kvos.cache.eviction import online_policies

    p.add_argument("--policies", nargs="+", default=["lru", "fifo", "lfu", "s3fifo", "arc"],
                   choices=list(online_policies()))
    p.add_argument("--rounds", type=int, default=24, help="hot requests (each followed by a cold one)")
    p.add_argument("--hot-blocks", type=int, default=16)
    p.add_argument("--cold-blocks", type=int, default=24)
    p.add_argument("--device-blocks", type=int, default=40)
    p.add_argument("--tier-slots", type=int, default=64)
    p.add_argument("--output", default="benchmarks/results/tier-parity-cpu.json")


def trace(rounds: int, hot_blocks: int, cold_blocks: int) -> list:
    """Segments (content id, tokens): hot prompt h is content h; request i's question 1000 + i;
    cold document j content 5000 + j."""
    from kvos.sim.traces import TraceRequest

    out = []
    for r in range(rounds):
        i = 2 * r
        out.append(TraceRequest(i * 10.0, (hot_blocks + 1) * BLOCK_SIZE, 1,
                                segments=[(r % 3, hot_blocks * BLOCK_SIZE), (1000 + i, BLOCK_SIZE)]))
        out.append(TraceRequest((i + 1) * 10.0, cold_blocks * BLOCK_SIZE, 1,
                                segments=[(5000 + r, cold_blocks * BLOCK_SIZE)]))
    return out


def token_ids(req) -> list[int]:
    ids: list[int] = []
    for content, n in req.segments:
        ids += random.Random(content).choices(range(100, 40000), k=n)
    return ids


def engine_hits(policy: str, reqs: list, device_blocks: int, tier_slots: int, make_llm=None) -> list[int]:
    """Tier hit tokens per request on the real engine (default model; ``make_llm``: how to build
    an ``LLM``, default ``kvos.LLM``)."""
    from kvos import LLM, SamplingParams

    make_llm = make_llm or LLM
    page = make_llm(num_blocks=device_blocks).engine.kv.stats()["page_bytes"]
    stride = -(-(page + 64) // 64) * 64  # a slot: the frame's header and payload, 64-byte aligned
    llm = make_llm(num_blocks=device_blocks, cpu_cache_gb=tier_slots * stride / 2**30, tier_eviction_policy=policy)
    cpu = next(t for t in llm.engine.offload.h.tiers if t.name == "cpu")
    hits = []
    for req in reqs:
        out = llm.generate([{"prompt_token_ids": token_ids(req)}], SamplingParams(max_tokens=1, temperature=0),
                           use_tqdm=False)[0]
        hits.append(out.metrics["cached_tokens_by_source"].get("cpu", 0))
    if cpu.arena is not None and cpu.arena.capacity_slots != tier_slots:
        raise RuntimeError(f"the CPU tier has {cpu.arena.capacity_slots} slots, not {tier_slots}")
    return hits


def sim_hits(policy: str, reqs: list, device_blocks: int, tier_slots: int) -> list[int]:
    """Tier hit tokens per request in the simulator."""
    from kvos.sim.cost_model import CostModel
    from kvos.sim.hardware import GPUS
    from kvos.sim.shapes import PRESETS
    from kvos.sim.simulator import SimConfig, Simulator
    from kvos.sim.tier import CPU_SOURCE, SimTierConfig

    cfg = SimConfig.of(block_size=BLOCK_SIZE, num_blocks=device_blocks, max_num_seqs=1,
                       tier=SimTierConfig(tier_slots, policy, "write_through"))
    sim = Simulator(reqs, cfg, CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"]))
    seen: dict = {}
    sim.schedule_hook = lambda out: [seen.setdefault(s.request.request_id, s.request) for s in out.seqs]
    sim.run()
    by_arrival = sorted(seen.values(), key=lambda r: r.arrival)
    return [r.cached_by_source.get(CPU_SOURCE, 0) for r in by_arrival]


def run(a: argparse.Namespace, make_llm=None) -> dict:
    from kvos.bench.machine import machine_info

    reqs = trace(a.rounds, a.hot_blocks, a.cold_blocks)
    rows = []
    print("| tier policy | engine | simulator | requests that agree |\n|---|---:|---:|---:|")
    for policy in a.policies:
        t0 = time.perf_counter()
        eng = engine_hits(policy, reqs, a.device_blocks, a.tier_slots, make_llm)
        sim = sim_hits(policy, reqs, a.device_blocks, a.tier_slots)
        same = sum(x == y for x, y in zip(eng, sim))
        rows.append({"policy": policy, "engine_tier_tokens": sum(eng), "sim_tier_tokens": sum(sim),
                     "engine_per_request": eng, "sim_per_request": sim, "requests_agree": same,
                     "agree": eng == sim, "seconds": time.perf_counter() - t0})
        print(f"| {policy} | {sum(eng):,} | {sum(sim):,} | {same} of {len(reqs)} |", flush=True)
    result = {"machine": machine_info(), "block_size": BLOCK_SIZE, "rounds": a.rounds, "hot_blocks": a.hot_blocks,
              "cold_blocks": a.cold_blocks, "device_blocks": a.device_blocks, "tier_slots": a.tier_slots,
              "requests": len(reqs), "prompt_tokens": sum(r.input_len for r in reqs), "rows": rows,
              "summary": {r["policy"]: {"engine": r["engine_tier_tokens"], "simulator": r["sim_tier_tokens"],
                                        "agree": r["agree"]} for r in rows}}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")
    return result
