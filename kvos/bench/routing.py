"""``kvos bench routing``: the routing table for fleets larger than anything run here. The
Mooncake trace is replayed across N simulated engines (the real scheduler and KV memory system
in each, ``kvos.sim.fleet``) behind every router, for each N, next to the reference of one
engine with all the fleet's memory.

Setup, and why:
- Llama-3.1-8B on an H100 (the cost model ``kvos bench policies`` uses), 512-token blocks as the
  Mooncake traces hash them. Each engine's pool is what an H100 holds (``--blocks``, default:
  ``--gpu-memory-utilization`` of its memory less the weights, in KV blocks: 912 blocks, 467K
  tokens, about 35 prompts of the conversation trace). A follow-up turn comes back a median of
  ~100 s (~350 requests, ~5M tokens) after its previous turn, so at 4 and 16 engines the cache
  decides what hits, and at 64 the fleet's memory exceeds that working set.
- Load: the trace as recorded (3.4 req/s, 13.5K-token prompts) is about one engine's worth of
  work. Replaying it as is across 64 engines would leave them idle and every router equal, so
  arrivals are compressed for each N until the offered load is ``--load`` (default 0.75) of the
  fleet's capacity: N times the request rate one engine sustains on the trace (measured: one
  engine of the same pool, every request of the first ``--calibration-requests`` arriving at
  once). ``--time-scale`` replays every N at that one scale instead (1: as recorded).
- Two references, each one engine with N times the blocks. ``one engine, all the memory`` runs
  at the time scale that loads that one engine to ``--load``: it has N times less compute than
  the fleet and serves an N-th of its requests at once, so its running requests pin an N-th of
  the blocks the fleet's do. ``one engine, all the memory and compute`` serves the fleet's own
  arrivals with N times the bandwidth and matrix rate, N times ``max_num_seqs`` and
  ``max_num_batched_tokens`` (an ideal N-way tensor-parallel engine): the same load on one
  shared cache. Compare hit rates with them, and TTFT among the routers only. ``upper_bound``
  is the unbounded single-cache block hit rate counted from the trace's hash ids (no
  simulation).
- kv_aware and approx run at each ``--kv-weights`` (default 1, Dynamo's default, and 64). In
  Dynamo's cost ``w * (P + R - H) + A`` the weight scales the engine's queued prefill as well as
  the request's uncached blocks, against the blocks it decodes (``kvos.router.KVAware``): at
  w=1 the decode load of a 13.5K-token conversation (~26 blocks per running request) outweighs
  a whole prompt's worth of hits, so the trace wants a larger weight.
- Engine settings (``--max-num-batched-tokens``, ``--max-num-seqs``) default to
  ``EngineConfig``'s; the published figures ran with 8192 and 256.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from kvos.bench.job_pool import job_pool
from kvos.config.flags import (
    add_config_args,
    add_engine_args,
    config_kwargs,
    engine_kwargs,
)
from kvos.router.config import RouterConfig
from kvos.router.policies import ROUTERS

ENGINE_FIELDS = ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization")
"""The ``EngineConfig`` fields of each simulated engine that the command takes."""
ROUTER_SETTINGS = ("router_balance", "router_queue_weight", "router_shared_balance", "router_shared_threshold",
                   "router_sole_margin")
"""The ``RouterConfig`` fields the command takes (the overlap weights are ``--kv-weights``)."""

TRACES = {"conversation": "mooncake_conversation.jsonl.gz", "synthetic": "mooncake_synthetic.jsonl.gz"}
REFERENCE = "one engine, all the memory"
SCALED_REFERENCE = "one engine, all the memory and compute"
REFERENCES = (REFERENCE, SCALED_REFERENCE)
WEIGHTED = ("kv_aware", "approx")
KEEP = ("block_hit_rate", "token_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s",
        "e2e_p90_s", "imbalance_requests", "imbalance_prompt_tokens", "imbalance_busy", "predicted_hit_blocks",
        "obtained_hit_blocks", "prediction_exact", "preemptions", "evictions", "makespan_s", "steps")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-dir", default="tests/data", help="folder holding the Mooncake traces (gzipped JSONL)")
    p.add_argument("--trace", default="conversation", choices=list(TRACES))
    p.add_argument("--limit", type=int, default=0, help="first N requests of the trace (0: all)")
    p.add_argument("--engines", type=int, nargs="+", default=[4, 16, 64], help="fleet sizes")
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    p.add_argument("--kv-weights", type=float, nargs="+", default=[1.0, 64.0],
                   help="kv_aware/approx overlap weights to compare (1: Dynamo's default)")
    p.add_argument("--blocks", type=int, default=None, help="512-token KV blocks per engine (default: what the GPU "
                                                            "holds at --gpu-memory-utilization)")
    p.add_argument("--load", type=float, default=0.75, help="offered load as a fraction of the fleet's capacity")
    p.add_argument("--time-scale", type=float, default=None,
                   help="replay every fleet at this arrival time scale instead of --load (1: as recorded)")
    p.add_argument("--calibration-requests", type=int, default=2000,
                   help="requests of the trace whose saturated one-engine throughput sets the capacity")
    add_engine_args(p, ENGINE_FIELDS)
    add_config_args(p, RouterConfig, ROUTER_SETTINGS)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--output", default="benchmarks/results/routing.json")
    p.add_argument("--plot", default="benchmarks/plots/routing.png")


def _setup(trace_path: str, limit: int):
    from kvos.sim.cost_model import CostModel
    from kvos.sim.hardware import GPUS
    from kvos.sim.shapes import PRESETS
    from kvos.sim.traces import load_mooncake

    trace = load_mooncake(trace_path, limit or None)
    return trace, CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])


def default_blocks(utilization: float) -> int:
    """KV blocks of 512 tokens an H100-80G holds for Llama-3.1-8B (bf16 weights, fp16 KV) at
    ``utilization`` of its memory."""
    from kvos.sim.cost_model import CostModel
    from kvos.sim.hardware import GPUS
    from kvos.sim.shapes import PRESETS

    gpu = GPUS["H100-80G"]
    cost = CostModel.for_model(PRESETS["llama-3.1-8b"], gpu)
    return int((utilization * gpu.memory_bytes - cost.weight_bytes) // (cost.kv_bytes_per_token * 512))


def _capacity(args: tuple) -> float:
    """Requests per second one engine sustains on the trace's first requests (all arriving at once)."""
    trace_path, limit, blocks, engine = args
    from kvos.sim.simulator import SimConfig, Simulator

    trace, cost = _setup(trace_path, limit)
    trace = [type(r)(0.0, r.input_len, r.output_len, r.hash_ids) for r in trace]
    r = Simulator(trace, SimConfig.of(block_size=512, num_blocks=blocks, **engine), cost).run()
    return len(trace) / r["makespan_s"]


def _one(args: tuple) -> dict:
    trace_path, limit, engines, router, weight, blocks, time_scale, engine, settings = args
    from kvos.sim.fleet import FleetSimulator
    from kvos.sim.simulator import SimConfig, Simulator

    trace, cost = _setup(trace_path, limit)
    t = time.perf_counter()
    if router == REFERENCE:
        cfg = SimConfig.of(block_size=512, num_blocks=blocks * engines, time_scale=time_scale * engines, **engine)
        r = Simulator(trace, cfg, cost).run()
    elif router == SCALED_REFERENCE:
        cfg = SimConfig.of(block_size=512, num_blocks=blocks * engines, time_scale=time_scale, **engine)
        cfg = cfg.replace(max_num_seqs=cfg.engine.max_num_seqs * engines,
                          max_num_batched_tokens=cfg.engine.max_num_batched_tokens * engines)
        cost = dataclasses.replace(cost, bandwidth=cost.bandwidth * engines, flops=cost.flops * engines)
        r = Simulator(trace, cfg, cost).run()
    else:
        cfg = SimConfig.of(block_size=512, num_blocks=blocks, time_scale=time_scale, **engine)
        routing = RouterConfig(router, 1.0 if weight is None else weight, **settings)
        r = FleetSimulator(trace, cfg, cost, engines, routing).run()
    row = {"engines": engines, "router": router, "kv_weight": weight, "time_scale": cfg.time_scale,
           "label": label(router, weight)}
    row.update({k: r.get(k) for k in KEEP})
    row["sim_wall_s"] = time.perf_counter() - t
    return row


def label(router: str, weight: float | None) -> str:
    """A row's name: the router, with its overlap weight for kv_aware and approx."""
    return router if weight is None else f"{router} w={weight:g}"


def upper_bound(trace) -> float:
    """Block hit rate of an unbounded cache of full blocks, from the trace's hash ids alone."""
    seen: set[int] = set()
    hit = total = 0
    for tr in sorted(trace, key=lambda r: r.arrival_s):
        n_full = tr.input_len // 512
        k = 0
        while k < n_full and tr.hash_ids[k] in seen:
            k += 1
        hit, total = hit + k, total + len(tr.hash_ids)
        seen.update(tr.hash_ids[:n_full])
    return hit / total if total else 0.0


def run(a: argparse.Namespace) -> dict:
    from kvos.bench.machine import machine_info

    path = str(Path(a.trace_dir) / TRACES[a.trace])
    trace, _ = _setup(path, a.limit)
    blocks = a.blocks or default_blocks(a.gpu_memory_utilization)
    t0 = time.perf_counter()
    with job_pool(a.jobs) as pool:
        per_engine_rps = None
        if a.time_scale is None:
            calib = min(len(trace), a.calibration_requests)
            per_engine_rps = pool.submit(_capacity, (path, calib, blocks, engine_kwargs(a, ENGINE_FIELDS))).result()
        span = trace[-1].arrival_s - trace[0].arrival_s
        trace_rps = len(trace) / span if span > 0 else float(len(trace))
        scales = {n: a.time_scale if a.time_scale is not None else trace_rps / (a.load * n * per_engine_rps)
                  for n in a.engines}
        settings = config_kwargs(a, RouterConfig, ROUTER_SETTINGS)
        jobs = [(path, a.limit, n, r, w, blocks, scales[n], engine_kwargs(a, ENGINE_FIELDS), settings)
                for n in a.engines for r in [*REFERENCES, *a.routers]
                for w in (a.kv_weights if r in WEIGHTED else [None])]
        rows = list(pool.map(_one, jobs))
    bound = upper_bound(trace)
    summary = summarize(rows, bound)
    print(table(a.trace, rows, blocks, bound))
    report = {"bench": "routing", "machine": machine_info(), "trace": a.trace, "limit": a.limit,
              "num_requests": len(trace), "block_size": 512, "blocks_per_engine": blocks,
              "model": "llama-3.1-8b", "gpu": "H100-80G", "kv_weights": a.kv_weights, **settings,
              "load": a.load,
              "per_engine_rps": per_engine_rps, "trace_rps": trace_rps, "time_scales": scales,
              "upper_bound_block_hit_rate": bound, "wall_s": time.perf_counter() - t0,
              "summary": summary, "results": rows}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if a.plot:
        from kvos.sim.plots import plot_routing

        plot_routing(rows, REFERENCES, Path(a.plot), f"Mooncake {a.trace} trace, {blocks} blocks per engine")
    print(f"saved {out}" + (f" and {a.plot}" if a.plot else ""))
    return report


def summarize(rows: list[dict], bound: float) -> list[dict]:
    """Per fleet size: each row's block hit rate; per kv_aware weight, its hit rate as a
    fraction of each one-engine reference's (``reference``: all the memory; ``scaled reference``:
    all the memory and compute) and round_robin's p90 TTFT over its own (goal >= 5)."""
    out = []
    for n in sorted({r["engines"] for r in rows}):
        at = {r["label"]: r for r in rows if r["engines"] == n}
        refs = {"reference": at.get(REFERENCE), "scaled reference": at.get(SCALED_REFERENCE)}
        rr = at.get("round_robin")
        s: dict = {"engines": n, "upper_bound": round(bound, 4)}
        s.update({f"{name} block_hit": round(r["block_hit_rate"], 4) for name, r in at.items()
                  if name not in REFERENCES})
        s.update({f"{key} block_hit": round(ref["block_hit_rate"], 4) for key, ref in refs.items() if ref is not None})
        for name, kv in at.items():
            if kv["router"] != "kv_aware":
                continue
            for key, ref in refs.items():
                if ref is not None and ref["block_hit_rate"] > 0:
                    s[f"{name} of {key} hit"] = round(kv["block_hit_rate"] / ref["block_hit_rate"], 3)
            if rr is not None and kv["ttft_p90_s"]:
                s[f"round_robin over {name} p90 TTFT"] = round(rr["ttft_p90_s"] / kv["ttft_p90_s"], 2)
        out.append(s)
    return out


def table(name: str, rows: list[dict], blocks: int, bound: float) -> str:
    lines = [f"\nMooncake {name} trace, {blocks} blocks of 512 tokens per engine; unbounded single-cache block hit "
             f"rate {bound:.1%}",
             f"{'engines':>7}  {'router':<40}{'block hit':>10}{'token hit':>10}{'TTFT p50':>11}{'TTFT p90':>11}"
             f"{'TTFT p99':>11}{'TPOT p50':>10}{'imb req':>8}{'imb busy':>9}{'pred/got':>9}{'wall':>7}"]
    for r in rows:
        ms = lambda x: "-" if x is None else f"{x * 1e3:,.0f} ms"  # noqa: E731
        pred = (f"{r['predicted_hit_blocks'] / r['obtained_hit_blocks']:.2f}"
                if r.get("obtained_hit_blocks") and r["router"] in ("kv_aware", "approx") else "-")
        ref = r["router"] in REFERENCES
        lines.append(f"{r['engines']:>7}  {r['label']:<40}{r['block_hit_rate']:>10.1%}{r['token_hit_rate']:>10.1%}"
                     f"{'(' + ms(r['ttft_p50_s']) + ')' if ref else ms(r['ttft_p50_s']):>11}"
                     f"{'(' + ms(r['ttft_p90_s']) + ')' if ref else ms(r['ttft_p90_s']):>11}"
                     f"{'(' + ms(r['ttft_p99_s']) + ')' if ref else ms(r['ttft_p99_s']):>11}"
                     f"{ms(r['tpot_p50_s']):>10}"
                     f"{'-' if ref else format(r['imbalance_requests'], '.2f'):>8}"
                     f"{'-' if ref else format(r['imbalance_busy'], '.2f'):>9}{pred:>9}{r['sim_wall_s']:>6.0f}s")
    lines.append("(the references' TTFT, in parentheses, is one engine's with other compute: not comparable)")
    return "\n".join(lines)
