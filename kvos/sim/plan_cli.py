"""``kvos plan``: how far one GPU (or a TP group) goes for a model."""
from __future__ import annotations

import argparse
import json

from kvos.config.flags import add_engine_args, non_negative, positive

PLAN_ENGINE_FIELDS = ("block_size", "gpu_memory_utilization", "kv_cache_memory_bytes", "encoder_cache_mb")
"""The ``EngineConfig`` fields the plan takes (flags, defaults and help are ``EngineConfig``'s)."""

EXAMPLES = """examples:
  kvos plan --model llama-3-70b --gpu H100-80G --weight-dtype fp16 --context-len 8192 --num-requests 32
  kvos plan --model llama-3.1-8b --gpu H100-80G --kv-dtype fp8 --context-len 32768 --json
  kvos plan --model llama-3.1-8b --kv-dtype fp8 --kv-cache-memory-bytes 60000000000  # an engine's pool
  kvos plan --model path/to/config.json --gpu L4 --weight-dtype int4 --tensor-parallel 2
  kvos plan --model model.gguf --gpu-memory-gib 48 --gpu-bandwidth-tbs 0.96 --gpu-tflops 181
  kvos plan --model gemma-3-270m --gpu L4 --context-len 8192 --length-dist 256:8192
  kvos plan --model gemma-3-27b --context-len 32768   # hybrid: homogeneous vs equal pages vs unified
  kvos plan --model llama-3.1-8b --draft-model llama-3.2-1b --context-len 8192  # with a draft's KV group

For a hybrid model (sliding-window and full-attention layers) the plan also compares the KV cache
layouts side by side at --context-len (+ --output-len) tokens per request: cache groups, page
size, pages per request, max concurrent requests and the KV waste at that load; "paged" is then
the unified layout (the engine's default).
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name, HF config.json (or its folder), or .gguf file")
    p.add_argument("--gpu", default="H100-80G", help="A100-80G, H100-80G, H200, L4")
    p.add_argument("--gpu-memory-gib", type=positive(float), default=None)
    p.add_argument("--gpu-bandwidth-tbs", type=positive(float), default=None)
    p.add_argument("--gpu-tflops", type=positive(float), default=None)
    p.add_argument("--weight-dtype", default="bf16", help="fp32, fp16, bf16, fp8, int8, int4")
    p.add_argument("--kv-dtype", default="fp16", help="fp16, bf16, fp8, int8")
    p.add_argument("--context-len", type=positive(int), default=8192, help="tokens per request (prompt, or all)")
    p.add_argument("--output-len", type=non_negative(int), default=0, help="output tokens added to --context-len")
    p.add_argument("--length-dist", default=None, metavar="LO:HI",
                   help="request lengths uniform in [LO, HI]: paged uses the mean, contiguous the max")
    p.add_argument("--num-requests", type=positive(int), default=1)
    p.add_argument("--tensor-parallel", "--tensor-parallel-size", dest="tensor_parallel", type=int, default=1,
                   help="GPUs one engine is sharded over: weights and KV heads per GPU (KV heads replicated past their count)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a speculative draft model (preset, config.json or .gguf): its weights and KV group count")
    p.add_argument("--images-per-request", type=non_negative(int), default=0,
                   help="images in each request (a vision-language model): their tokens add to --context-len")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_engine_args(p, PLAN_ENGINE_FIELDS, title="engine (the pool the plan sizes)")


def run(a: argparse.Namespace) -> int:
    from kvos.sim.hardware import resolve_gpu
    from kvos.sim.planner import PlanInput, format_plan, plan
    from kvos.sim.shapes import resolve_shape

    context, mean = a.context_len, None
    if a.length_dist:
        try:
            lo, hi = (int(x) for x in a.length_dist.split(":"))
        except ValueError:
            raise ValueError(f"length_dist must be LO:HI, got {a.length_dist!r}") from None
        if not 1 <= lo <= hi:
            raise ValueError(f"length_dist must satisfy 1 <= LO <= HI, got {a.length_dist!r}")
        context, mean = hi, (lo + hi) / 2
    inp = PlanInput(resolve_shape(a.model), resolve_gpu(a.gpu, a.gpu_memory_gib, a.gpu_bandwidth_tbs, a.gpu_tflops),
                    a.weight_dtype, a.kv_dtype, context, a.output_len, mean, a.num_requests,
                    a.gpu_memory_utilization, a.block_size, a.tensor_parallel,
                    kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                    draft=resolve_shape(a.draft_model) if a.draft_model else None,
                    images_per_request=a.images_per_request, encoder_cache_bytes=int(a.encoder_cache_mb * (1 << 20)))
    result = plan(inp)
    print(json.dumps(result, indent=2) if a.json else format_plan(result))
    return 0
