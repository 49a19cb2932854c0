"""The CPU tier's eviction policy on the real engine against the simulator, one trace.

A scan-resistance trace: three hot system prompts (16 blocks each, each request adding a
one-block question) alternate with cold one-off documents (32 blocks), so between two uses of a
hot prompt three cold documents pass through the tier. The device pool (40 blocks) keeps about
one request, so every later hit comes from the CPU tier (64 slots, write-through). Requests run
one at a time (one output token each). The engine runs the default model on token ids (each
content id a fixed random token list); the simulator runs the same trace (``TraceRequest``
segments) with the same settings. Prints and saves tier hit tokens per policy for both.

    .venv/bin/python benchmarks/scripts/tier_policy_engine_vs_sim.py [out.json]
"""
from __future__ import annotations

import json
import random
import sys
import time

from kvos import LLM, SamplingParams
from kvos.bench.machine import machine_info
from kvos.sim.cost_model import CostModel
from kvos.sim.hardware import GPUS
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SimConfig, Simulator
from kvos.sim.tier import SimTierConfig
from kvos.sim.traces import TraceRequest

BS, DEVICE_BLOCKS, TIER_SLOTS = 16, 40, 64
HOT, HOT_BLOCKS, COLD_BLOCKS, ROUNDS = 3, 16, 32, 24
POLICIES = ("lru", "s3fifo", "fifo", "lfu")


def trace() -> list[TraceRequest]:
    """(content id, length) segments: hot prompt h is content h; request i's question is 1000 + i;
    cold document j is content 5000 + j."""
    out = []
    for r in range(ROUNDS):
        i = 2 * r
        out.append(TraceRequest(i * 10.0, (HOT_BLOCKS + 1) * BS, 1, segments=[(r % HOT, HOT_BLOCKS * BS), (1000 + i, BS)]))
        out.append(TraceRequest((i + 1) * 10.0, COLD_BLOCKS * BS, 1, segments=[(5000 + r, COLD_BLOCKS * BS)]))
    return out


def token_ids(req: TraceRequest) -> list[int]:
    ids = []
    for content, n in req.segments:
        ids += random.Random(content).choices(range(100, 40000), k=n)
    return ids


def engine_run(policy: str, reqs: list[TraceRequest]) -> dict:
    probe = LLM(num_blocks=DEVICE_BLOCKS)
    page = probe.engine.kv.stats()["page_bytes"]
    del probe
    stride = -(-(page + 64) // 64) * 64  # a slot: the frame's header and payload, 64-byte aligned
    llm = LLM(num_blocks=DEVICE_BLOCKS, cpu_cache_gb=TIER_SLOTS * stride / 2**30, tier_eviction_policy=policy)
    t0 = time.perf_counter()
    for req in reqs:
        llm.generate([{"prompt_token_ids": token_ids(req)}], SamplingParams(max_tokens=1, temperature=0),
                     use_tqdm=False)
    s = llm.stats()
    return {"tier_hit_tokens": s["tier_hits_tokens"], "device_hit_tokens": s["prefix_hits_tokens"] - s["tier_hits_tokens"],
            "tier": s.get("tiers"), "seconds": time.perf_counter() - t0}


def sim_run(policy: str, reqs: list[TraceRequest]) -> dict:
    cfg = SimConfig.of(block_size=BS, num_blocks=DEVICE_BLOCKS, max_num_seqs=1,
                       tier=SimTierConfig(TIER_SLOTS, policy, "write_through"))
    report = Simulator(reqs, cfg, CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])).run()
    return {"tier_hit_tokens": round(report["tier_token_hit_rate"] * sum(r.input_len for r in reqs))}


def main() -> None:
    reqs = trace()
    rows = []
    for policy in POLICIES:
        row = {"policy": policy, "engine": engine_run(policy, reqs), "simulator": sim_run(policy, reqs)}
        print(policy, row["engine"]["tier_hit_tokens"], row["simulator"]["tier_hit_tokens"], flush=True)
        rows.append(row)
    result = {"machine": machine_info(), "device_blocks": DEVICE_BLOCKS, "tier_slots": TIER_SLOTS,
              "requests": len(reqs), "prompt_tokens": sum(r.input_len for r in reqs), "rows": rows}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
