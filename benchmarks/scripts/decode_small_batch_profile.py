"""Where a small-batch decode step's time goes on the GPU: one engine decode step (the captured
CUDA graph + the logits projection) of Llama-3.1-8B's shape with random weights, timed in a
graph of repeated steps, then profiled (torch.profiler traces the kernels inside the graph
replay). Prints JSON lines: the step time against the HBM roofline, the kernel time summed by
kind and the idle time between kernels (GPU only). ``--cublas``: one-row weight products on
cuBLAS (as before ``kvos.kernels.gemv``); ``KVOS_PDL=0``: no dependent launches. Under dependent
launches a kernel's time includes its wait for the one before, so the idle time goes negative.

    python benchmarks/scripts/decode_small_batch_profile.py [--cublas] [batch ...]
    CTX=8192 KV=fp8_e4m3 python ...   # another context (default 512) and KV cache dtype (default auto)
"""
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvos import LLM
from kvos.bench.roofline import ModelCost, measure_ceilings
from kvos.models import ops  # noqa: E402

if "--cublas" in sys.argv:  # the weight products on cuBLAS at every row count (the comparison)
    ops.ONE_ROW_KERNEL = False
    sys.argv.remove("--cublas")
batches = [int(b) for b in sys.argv[1:]] or [1]
ctx = int(os.environ.get("CTX", 512))
llm = LLM(model="llama-3.1-8b", random_weights=True, device="cuda", max_num_seqs=max(batches),
          max_num_batched_tokens=2048, kv_cache_dtype=os.environ.get("KV", "auto"))
runner = llm.engine.runner
g = runner.graphs
bs = runner.block_size
nb = min(p.num_blocks for p in llm.engine.kv.pools)
ceil = measure_ceilings()
cost = ModelCost.of(runner.model, 2, llm.engine.layout)  # K/V bytes as the cache stores them (scales too)
print(json.dumps({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "kv_cache_dtype": os.environ.get("KV", "auto"),
                  "context": ctx}), flush=True)


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (("combine", "attention_combine"), ("gemv", "gemm"), ("gemm", "gemm"), ("nvjet", "gemm"),
                       ("cutlass", "gemm"), ("sm90", "gemm"),
                       ("decode", "attention"), ("rms", "rms_norm"), ("rope", "rope"), ("rotary", "rope"),
                       ("write", "kv_write"), ("silu", "silu_mul"), ("gated", "silu_mul"), ("embedding", "embedding"),
                       ("index", "embedding")):
        if key in n:
            return label
    return name[:60]


for b in batches:
    blocks = -(-ctx // bs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tables = torch.randint(1, nb, (1, b, blocks), dtype=torch.int32, device="cuda", generator=gen)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    pos = torch.full((b,), ctx - 1, dtype=torch.long, device="cuda")
    slots = tables[:, :, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
    ids = torch.randint(3, runner.cfg.vocab_size, (b,), device="cuda", generator=gen)
    size = next(s for s in g.sizes if s >= b)

    def step():
        with torch.inference_mode():
            g.graphs[size].replay()
            return runner.model.compute_logits(g.outputs[size][:b])

    with torch.inference_mode():
        g.run(ids, pos, slots, tables, seq_lens)
    # a graph of graph replays is not allowed: time the replays between events instead
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(8):
            step()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 8)
    step_ms = sorted(times)[len(times) // 2]
    roof_ms = cost.decode_seconds([ctx] * b, ceil) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0),
                    key=lambda e: e.time_range.start)
    kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    per_step = len(kernels) / 3
    busy = sum(e.device_time for e in kernels) / 3 / 1e3
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in kernels:
        by_kind[kind(e.name)] += e.device_time / 3 / 1e3
        count[kind(e.name)] += 1
    names = defaultdict(float)
    for e in kernels:
        names[e.name[:90]] += e.device_time / 3 / 1e3
    print(json.dumps({"batch": b, "context": ctx, "step_ms": round(step_ms, 4), "roofline_ms": round(roof_ms, 4),
                      "of_roofline": round(roof_ms / step_ms, 3), "kernels_per_step": per_step,
                      "kernel_busy_ms": round(busy, 4), "idle_ms": round(step_ms - busy, 4),
                      "by_kind_ms": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                      "count_per_step": {k: v / 3 for k, v in count.items()},
                      "top_names_ms": dict(sorted(((k, round(v, 4)) for k, v in names.items()), key=lambda kv: -kv[1])[:14])}),
          flush=True)
