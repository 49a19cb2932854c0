"""``kvos simulate``: replay a trace through the real scheduler and KV memory system."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvos.cache.eviction import EVICTION_POLICIES
from kvos.config.flags import (
    add_config_args,
    add_engine_args,
    config_kwargs,
    engine_kwargs,
    non_negative,
    positive,
)
from kvos.router.config import RouterConfig
from kvos.sim.options import SimOptions
from kvos.sim.tier import SimTierConfig

SIM_ENGINE_FIELDS = ("block_size", "kv_layout", "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len", "scheduling_policy", "fairness_steps", "preemption_order", "eviction_policy",
                     "eviction_lookahead", "segment_reuse", "segment_recompute", "mamba_cache_every",
                     "encoder_cache_mb")
"""The ``EngineConfig`` fields that shape a simulated engine (flags, defaults and checks are
``EngineConfig``'s; the pool's size comes from --cache-blocks/--cache-tokens/--cache-gb)."""
SIM_TIER_FIELDS = ("tier_eviction_policy", "write_policy", "tier_lookahead")
"""The ``EngineConfig`` fields of the simulated CPU tier."""

EXAMPLES = """examples:
  kvos simulate --trace conversation_trace.jsonl --block-size 512 --cache-blocks unlimited --json \\
                --max-num-batched-tokens 8192 --max-num-seqs 256
  kvos simulate --trace conversation_trace.jsonl --block-size 512 --cache-blocks 2000 --eviction-policy belady
  kvos simulate --synthetic --num-requests 500 --rate 8 --system-prompt-len 1000 --num-system-prompts 4 \\
                --cache-gb 10 --scheduling-policy lpm
  kvos simulate --synthetic --turns 4 --allocator contiguous --max-model-len 4096
  kvos simulate --synthetic --rag --num-docs 20 --doc-len 1000 --docs-per-prompt 4 --input-len 32:64 \
                --system-prompt-len 200 --segment-reuse --segment-recompute 0.15
  kvos simulate --synthetic --model gemma-3-27b --allocator contiguous --kv-layout homogeneous --max-model-len 4096
  kvos simulate --synthetic --images --num-images 8 --model gemma-3-12b --gpu H200 --input-len 16:64 \
      --encoder-cache-mb 0                      # image chats sharing 8 images, without the encoder cache
  kvos simulate --trace conversation_trace.jsonl --block-size 512 --limit 3000 \\
                --sweep cache-size --sweep-policies lru fifo lfu belady --plot-dir plots/
  kvos simulate --synthetic --input-len 1024:4096 --model gemma-3-27b --kv-layout unified --cache-gb 20
  kvos simulate --synthetic --input-len 1024:4096 --model gemma-3-27b --kv-layout homogeneous --cache-gb 20
  kvos simulate --trace conversation_trace.jsonl --block-size 512 --cache-blocks 2000 --tier-blocks 8000 \\
                --tier-policy lru --tier-write-policy write_back
  kvos simulate --trace conversation_trace.jsonl --block-size 512 --cache-blocks 800 --engines 16 \\
                --router kv_aware --kv-weight 1 --time-scale 0.08 --max-num-batched-tokens 8192 --max-num-seqs 256

With --engines N > 1 the trace is routed across N engines (--router), each with the pool and
scheduler given here (pool sizes are per engine); the report adds load imbalance and the
router's predicted against obtained prefix hits.

With a hybrid --model (sliding-window and full-attention layers, e.g. Gemma 3) the KV memory
system runs the model's cache layout (--kv-layout, default unified; the contiguous allocator needs
homogeneous): several cache groups in one pool of large pages; --cache-blocks then counts large pages, and the report adds the layout,
mean KV waste and each group's peak blocks. Other models keep the abstract one-layer spec.
"""


def add_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, help="Mooncake JSONL, or a JSON list of {input_length, output_length}")
    w.add_argument("--synthetic", action="store_true", help="generate a workload instead of reading one")
    w.add_argument("--limit", type=positive(int), default=None, help="first N requests of the trace")
    w.add_argument("--num-requests", type=positive(int), default=200)
    w.add_argument("--rate", type=positive(float), default=4.0,
                   help="Poisson arrivals per second (synthetic, lengths JSON)")
    w.add_argument("--input-len", default="64:1024", metavar="LO:HI")
    w.add_argument("--output-len", default="16:256", metavar="LO:HI")
    w.add_argument("--system-prompt-len", type=non_negative(int), default=0)
    w.add_argument("--num-system-prompts", type=positive(int), default=1)
    w.add_argument("--turns", type=positive(int), default=1, help="turns per multi-turn session")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--rag", action="store_true",
                   help="synthetic retrieval prompts: system prompt, --docs-per-prompt of --num-docs documents in "
                        "random order, a question (--input-len is the question's length); with --segment-reuse")
    w.add_argument("--images", action="store_true",
                   help="synthetic image chats: a text of its own (--input-len), one of --num-images images (a "
                        "vision --model's tokens per image), a question (--question-len); with --synthetic")
    w.add_argument("--num-images", type=positive(int), default=8)
    w.add_argument("--question-len", default="16:64", metavar="LO:HI")
    w.add_argument("--num-docs", type=positive(int), default=20)
    w.add_argument("--doc-len", type=positive(int), default=1000)
    w.add_argument("--docs-per-prompt", type=positive(int), default=4)
    m = p.add_argument_group("cost model")
    m.add_argument("--model", default="llama-3.1-8b",
                   help="preset, config.json or .gguf: sets the cost model and, for a hybrid model (sliding-window "
                        "layers), the KV cache layout; other models use the abstract one-layer spec")
    m.add_argument("--gpu", default="H100-80G")
    m.add_argument("--weight-dtype", default="bf16")
    m.add_argument("--kv-dtype", default="fp16")
    m.add_argument("--tensor-parallel", type=positive(int), default=1)
    m.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a speculative draft model (preset, config.json or .gguf): its KV is a cache group of the "
                        "pool (memory only: the cost model does not time drafting)")
    m.add_argument("--calibration", default=None, help="JSON of measured steps to fit the cost model to")
    c = p.add_argument_group("cache size")
    c.add_argument("--cache-blocks", default="unlimited",
                   help="pool size in blocks (with a hybrid --model: in the layout's large pages), or 'unlimited'")
    c.add_argument("--cache-tokens", type=int, default=None, help="pool size in tokens (not for a hybrid --model)")
    c.add_argument("--cache-gb", type=float, default=None,
                   help="pool size in GiB of KV for --model (all its KV heads; --kv-dtype)")
    add_engine_args(p, SIM_ENGINE_FIELDS, title="engine (the scheduler and KV cache)",
                    choices={"eviction_policy": EVICTION_POLICIES})
    add_config_args(p, SimOptions, title="simulator")
    t = p.add_argument_group("a CPU tier below the device")
    t.add_argument("--tier-blocks", type=int, default=0, help="CPU-tier slots in device blocks (0: no tier)")
    t.add_argument("--tier-gb", type=float, default=None, help="CPU-tier size in GiB of KV for --model")
    t.add_argument("--tier-bandwidth-gbs", type=float, default=SimTierConfig.load_bandwidth / 1e9,
                   help="tier-to-device load rate in GB/s (kvos's measured CPU-tier loads on an H100 host)")
    add_engine_args(p, SIM_TIER_FIELDS, spell={"write_policy": "--tier-write-policy"})
    f = p.add_argument_group("a fleet of engines behind a router")
    f.add_argument("--engines", type=int, default=1, help="simulated engines (1: a single engine, no router)")
    f.add_argument("--approx-blocks", type=int, default=None,
                   help="approx: prompt blocks remembered per engine; kv_aware/approx: block use counts kept per "
                        "engine by the shared-prefix guard (default: the engine's pool size)")
    add_config_args(p, RouterConfig)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--output", default=None, help="also save the JSON report here")
    o.add_argument("--sweep", choices=["cache-size"], default=None)
    o.add_argument("--sweep-sizes", type=int, nargs="+", default=None, help="pool sizes in blocks")
    o.add_argument("--sweep-policies", nargs="+", default=["lru", "belady"])
    o.add_argument("--plot-dir", default="plots")
    o.add_argument("--progress", action="store_true")


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{name} must be LO:HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 1 <= LO <= HI, got {text!r}")
    return lo, hi


def load_workload(a: argparse.Namespace):
    from kvos.sim import traces

    if a.synthetic == bool(a.trace):
        raise ValueError("trace: give exactly one of --trace FILE or --synthetic")
    if a.synthetic and a.rag:
        return traces.rag(a.num_requests, a.rate, a.num_docs, a.doc_len, a.docs_per_prompt,
                          _range(a.input_len, "input_len"), _range(a.output_len, "output_len"), a.system_prompt_len,
                          a.seed)
    if a.rag:
        raise ValueError("rag: --rag generates a workload; give it with --synthetic")
    if a.images:
        from kvos.sim.shapes import resolve_shape

        vision = resolve_shape(a.model).vision
        if not a.synthetic or vision is None:
            raise ValueError("images: --images generates a workload with --synthetic, for a vision --model "
                             "(e.g. gemma-3-12b)")
        return traces.images(a.num_requests, a.rate, a.num_images, vision.tokens_per_image,
                             _range(a.input_len, "input_len"), _range(a.question_len, "question_len"),
                             _range(a.output_len, "output_len"), a.seed)
    if a.synthetic:
        return traces.synthetic(a.num_requests, a.rate, _range(a.input_len, "input_len"),
                                _range(a.output_len, "output_len"), a.system_prompt_len, a.num_system_prompts,
                                a.turns, a.seed)
    path = Path(a.trace)
    if not path.exists():
        raise ValueError(f"trace: {a.trace!r} does not exist")
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return traces.load_mooncake(path, a.limit)
    reqs = traces.load_lengths_json(path, a.rate, a.seed)
    return reqs[: a.limit] if a.limit else reqs


def build(a: argparse.Namespace):
    """The simulated engine's ``SimConfig`` and cost model from the parsed flags."""
    import dataclasses

    from kvos.config.engine import EngineConfig
    from kvos.sim.cost_model import CostModel
    from kvos.sim.hardware import KV_DTYPES, kv_bytes_per_token, resolve_gpu
    from kvos.sim.planner import draft_layout, model_layout
    from kvos.sim.shapes import resolve_shape
    from kvos.sim.simulator import SimConfig

    engine = EngineConfig(**engine_kwargs(a, SIM_ENGINE_FIELDS + SIM_TIER_FIELDS))  # checks the engine's fields
    options = SimOptions(**config_kwargs(a, SimOptions))
    shape = resolve_shape(a.model)
    if a.kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {a.kv_dtype!r}")
    bs = engine.block_size
    cost = CostModel.for_model(shape, resolve_gpu(a.gpu), a.weight_dtype, a.kv_dtype, a.tensor_parallel)
    if a.calibration:
        cost.calibrate(a.calibration)
    layout = (model_layout(shape, a.kv_dtype, bs, engine.kv_layout, cache_every=engine.mamba_cache_every)
              if shape.is_hybrid else None)
    if a.draft_model:
        layout = draft_layout(shape, resolve_shape(a.draft_model), a.kv_dtype, bs, engine.kv_layout)
    if a.cache_gb is not None:
        if layout is not None:
            blocks = layout.num_pages_for_memory(int(a.cache_gb * (1 << 30)))
        else:
            per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, a.kv_dtype)
            blocks = int(a.cache_gb * (1 << 30) // (per_token * bs))
    elif a.cache_tokens is not None:
        if layout is not None:
            raise ValueError(f"cache_tokens: a pool of several cache groups (a hybrid model, a draft model) holds "
                             f"different tokens per group; give "
                             f"--cache-gb or --cache-blocks (large pages of {layout.large_page_bytes:,} B)")
        blocks = a.cache_tokens // bs
    elif str(a.cache_blocks) == "unlimited":
        blocks = None
    else:
        try:
            blocks = int(a.cache_blocks)
        except ValueError:
            raise ValueError(f"cache_blocks must be a number or 'unlimited', got {a.cache_blocks!r}") from None
    if blocks is not None and blocks < 2:
        raise ValueError(f"cache_blocks must be at least 2, got {blocks}")
    tier = None
    tier_blocks = a.tier_blocks
    if a.tier_gb is not None:
        tier_blocks = int(a.tier_gb * (1 << 30) // (cost.kv_bytes_per_token * bs))
    if tier_blocks:
        tier = SimTierConfig(tier_blocks, engine.tier_eviction_policy, engine.write_policy, a.tier_bandwidth_gbs * 1e9,
                             engine.tier_lookahead)
    cfg = SimConfig(dataclasses.replace(engine, num_blocks=blocks), options, layout, tier)
    return cfg, cost


def format_report(r: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:,.1f} ms"

    if "kv_layout" in r:
        runs: list[list] = []  # [text, count]
        for g in r["kv_groups"]:
            kind = ("mamba state" if g.get("kind") == "mamba_state" else
                    "full" if g["window"] is None else "sliding " + str(g["window"]))
            text = (f"{kind} x {g['layers']} layers"
                    f"{' (+' + str(g['padding_layers']) + ' pad)' if g['padding_layers'] else ''}, "
                    f"{g['blocks_per_large_page']}/page")
            if runs and runs[-1][0] == text:
                runs[-1][1] += 1
            else:
                runs.append([text, 1])
        groups = "; ".join(t if c == 1 else f"{c} groups: {t}" for t, c in runs)
        cache = (f"{r['num_blocks']} large pages of {r['page_bytes']:,} B ({r['kv_layout']}: {groups}), "
                 f"{r['block_size']}-token blocks")
    else:
        cache = f"{r['num_blocks']} blocks x {r['block_size']} tokens"
    rows = [("requests", f"{r['num_requests']:,}"),
            ("cache", f"{cache}, {r['allocator']}, evict {r['eviction_policy']}, "
                      f"schedule {r['scheduling_policy']}"),
            ("hit rate", f"blocks {r['block_hit_rate']:.2%}, tokens {r['token_hit_rate']:.2%}"),
            ("TTFT", f"p50 {ms(r['ttft_p50_s'])}, p90 {ms(r['ttft_p90_s'])}, p99 {ms(r['ttft_p99_s'])}"),
            ("TPOT", f"p50 {ms(r['tpot_p50_s'])}, p90 {ms(r['tpot_p90_s'])}"),
            ("e2e", f"p50 {ms(r['e2e_p50_s'])}, p90 {ms(r['e2e_p90_s'])}"),
            ("throughput", f"{r['throughput_tok_s']:,.0f} output tok/s, {r['total_tok_s']:,.0f} total tok/s"),
            ("KV utilisation", f"{r['kv_utilization']:.1%} of reserved slots hold tokens" if "kv_waste_mean" not in r
             else f"{r['kv_utilization']:.1%} of held bytes hold live KV; mean waste {r['kv_waste_mean']:.1%}"),
            ("concurrency", f"{r['running_mean']:,.1f} running requests on average, peak {r['running_peak']:,}"),
            ("events", f"preemptions {r['preemptions']:,}, evictions {r['evictions']:,}, "
                       f"recomputed tokens {r['recomputed_tokens']:,}"),
            *([("CPU tier", f"{r['tier_blocks']:,} blocks, evict {r['tier_policy']} (lookahead {r['tier_lookahead']}), "
                            f"{r['tier_write_policy']}; "
                            f"served {r['tier_token_hit_rate']:.2%} of prompt tokens, loaded "
                            f"{r['tier_loaded_blocks']:,} blocks ({r['tier_load_busy_s']:,.2f} s of link time)")]
              if "tier_blocks" in r else []),
            *([("segment reuse", f"recompute {r['segment_recompute']:.0%}: {r['segment_hits']:,} segment hits, "
                                 f"{r['segment_reused_tokens']:,} tokens reused, {r['segment_recomputed_tokens']:,} "
                                 f"recomputed; {r['segment_fills']:,} segments filled alone; prefix hits "
                                 f"{r['prefix_hit_tokens']:,} tokens")]
              if "segment_hits" in r else []),
            *([("images", f"{r['encoder_runs']:,} encoder runs ({r['encoder_seconds']:,.2f} s), "
                          f"{r['encoder_cache_hits']:,} encoder-cache hits, {r['encoder_cache_evictions']:,} evicted")]
              if "encoder_runs" in r else []),
            *([("group peak blocks", ", ".join(f"{b:,}" for b in r["group_peak_blocks"]))]
              if "group_peak_blocks" in r else []),
            ("simulated", f"{r['makespan_s']:,.1f} s in {r['steps']:,} steps; wall {r['sim_wall_s']:.1f} s")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_fleet_report(r: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:,.1f} ms"

    weight = f" (weight {r['overlap_weight']:g})" if r["overlap_weight"] is not None else ""
    rows = [("requests", f"{r['num_requests']:,} ({r['rejected_requests']:,} rejected)"),
            ("fleet", f"{r['num_engines']} engines x {r['num_blocks_per_engine']} blocks x {r['block_size']} "
                      f"tokens, evict {r['eviction_policy']}, schedule {r['scheduling_policy']}"),
            ("router", r["router"] + weight),
            ("hit rate", f"blocks {r['block_hit_rate']:.2%}, tokens {r['token_hit_rate']:.2%}"),
            ("predicted hits", f"{r['predicted_hit_blocks']:,} blocks predicted, {r['obtained_hit_blocks']:,} "
                               f"obtained; exact for {r['prediction_exact']:.1%} of requests"),
            ("TTFT", f"p50 {ms(r['ttft_p50_s'])}, p90 {ms(r['ttft_p90_s'])}, p99 {ms(r['ttft_p99_s'])}"),
            ("TPOT", f"p50 {ms(r['tpot_p50_s'])}, p90 {ms(r['tpot_p90_s'])}"),
            ("e2e", f"p50 {ms(r['e2e_p50_s'])}, p90 {ms(r['e2e_p90_s'])}"),
            ("imbalance (max/mean)", f"requests {r['imbalance_requests']:.2f}, prompt tokens "
                                     f"{r['imbalance_prompt_tokens']:.2f}, busy time {r['imbalance_busy']:.2f}"),
            ("requests per engine", ", ".join(f"{n:,}" for n in r["requests_per_engine"])),
            ("throughput", f"{r['throughput_tok_s']:,.0f} output tok/s"),
            ("events", f"preemptions {r['preemptions']:,}, evictions {r['evictions']:,}, "
                       f"recomputed tokens {r['recomputed_tokens']:,}"),
            ("simulated", f"{r['makespan_s']:,.1f} s in {r['steps']:,} steps; wall {r['sim_wall_s']:.1f} s")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def sweep(a: argparse.Namespace, trace, base_cfg, cost) -> dict:
    from kvos.sim.plots import plot_hit_rate_vs_size, plot_ttft_cdf
    from kvos.sim.simulator import Simulator

    sizes = a.sweep_sizes or [2 ** k for k in range(6, 14)]
    results: dict[str, list[dict]] = {}
    for policy in a.sweep_policies:
        for size in sizes:
            cfg = base_cfg.replace(num_blocks=size, eviction_policy=policy)
            r = Simulator(trace, cfg, cost).run(progress=a.progress)
            results.setdefault(policy, []).append(r)
            print(f"{policy:>7} {size:>7} blocks: block hit {r['block_hit_rate']:.2%}, "
                  f"token hit {r['token_hit_rate']:.2%}, TTFT p50 {r['ttft_p50_s'] * 1e3:,.1f} ms", flush=True)
    out = Path(a.plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    hit_png = plot_hit_rate_vs_size(results, sizes, base_cfg.block_size, out / "hit_rate_vs_cache_size.png")
    cdf_png = plot_ttft_cdf(results, out / "ttft_cdf.png")
    summary = {p: [{k: v for k, v in r.items() if k != "ttft_s"} for r in rs] for p, rs in results.items()}
    return {"sweep": "cache-size", "sizes_blocks": sizes, "results": summary,
            "plots": [str(hit_png), str(cdf_png)]}


def run(a: argparse.Namespace) -> int:
    from kvos.sim.simulator import Simulator

    trace = load_workload(a)
    cfg, cost = build(a)
    if a.engines < 1:
        raise ValueError(f"engines must be >= 1, got {a.engines}")
    if a.engines > 1:
        if a.sweep:
            raise ValueError("sweep: not available with --engines > 1 (kvos bench routing sweeps fleets)")
        from kvos.sim.fleet import FleetSimulator

        router = RouterConfig(**config_kwargs(a, RouterConfig))
        report = FleetSimulator(trace, cfg, cost, a.engines, router,
                                approx_capacity=a.approx_blocks).run(progress=a.progress)
        report.pop("ttft_s")
        print(json.dumps(report, indent=2) if a.json else format_fleet_report(report))
    elif a.sweep:
        report = sweep(a, trace, cfg, cost)
        if a.json:
            print(json.dumps(report, indent=2))
    else:
        report = Simulator(trace, cfg, cost).run(progress=a.progress)
        report.pop("ttft_s")
        print(json.dumps(report, indent=2) if a.json else format_report(report))
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(report, indent=2))
    return 0
