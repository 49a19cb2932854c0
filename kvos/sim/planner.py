"""Memory math: KV bytes per token and request, pool size, concurrency, decode roofline."""
from __future__ import annotations

from dataclasses import dataclass

from kvos.sim.hardware import GIB, GPU, KV_BYTES, WEIGHT_BYTES
from kvos.sim.shapes import ModelShape


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PlanInput:
    shape: ModelShape
    gpu: GPU
    weight_dtype: str = "bf16"
    kv_dtype: str = "fp16"
    context_len: int = 8192
    output_len: int = 0
    mean_len: float | None = None  # mean tokens per request when lengths vary (default: max)
    num_requests: int = 1
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    tensor_parallel: int = 1
    max_num_batched_tokens: int = 8192
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.weight_dtype not in WEIGHT_BYTES:
            raise ValueError(f"weight_dtype must be one of {sorted(WEIGHT_BYTES)}, got {self.weight_dtype!r}")
        if self.kv_dtype not in KV_BYTES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_BYTES)}, got {self.kv_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("context_len", "num_requests", "block_size", "tensor_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def kv_per_layer_token(shape: ModelShape, kv_dtype: str, tp: int) -> int:
    """K and V of one token in one layer, on one GPU (KV heads split over TP, replicated below 1)."""
    heads = max(1, shape.num_kv_heads // tp)
    return 2 * heads * shape.head_dim * KV_BYTES[kv_dtype]


def kv_bytes_for_len(shape: ModelShape, per_layer: int, tokens: int, block_size: int | None) -> int:
    """KV bytes one request of ``tokens`` tokens holds. Sliding layers hold at most the window
    (paged: the blocks the window can touch); ``block_size=None`` means exact token counts."""
    if block_size is None:
        full = tokens
        slide = min(tokens, shape.sliding_window or tokens)
    else:
        full = cdiv(tokens, block_size) * block_size
        slide_blocks = cdiv(tokens, block_size)
        if shape.sliding_window:
            slide_blocks = min(slide_blocks, cdiv(shape.sliding_window, block_size) + 1)
        slide = slide_blocks * block_size
    return per_layer * (shape.full_layers * full + shape.sliding_layers * slide)


def plan(p: PlanInput) -> dict:
    s, g, tp = p.shape, p.gpu, p.tensor_parallel
    per_layer = kv_per_layer_token(s, p.kv_dtype, tp)
    total_len = p.context_len + p.output_len
    mean_len = int(round(p.mean_len)) if p.mean_len else total_len
    weights = int(s.params * WEIGHT_BYTES[p.weight_dtype] / tp)
    act = int(p.max_num_batched_tokens * (4 * s.hidden_size + 2 * s.intermediate_size // tp) * 2
              + 256 * s.vocab_size * 4 // tp)
    budget = int(g.memory_bytes * p.gpu_memory_utilization)
    kv_memory = max(0, budget - weights - act)
    per_req_exact = kv_bytes_for_len(s, per_layer, total_len, None)
    per_req_paged = kv_bytes_for_len(s, per_layer, mean_len, p.block_size)
    contiguous_req = per_layer * s.num_layers * total_len  # Era 1: max length, every layer
    page = per_layer * s.num_layers * p.block_size
    max_paged = kv_memory // per_req_paged if per_req_paged else 0
    max_contig = kv_memory // contiguous_req if contiguous_req else 0
    batch = max(1, min(max_paged, 4096))
    kv_read = kv_bytes_for_len(s, per_layer, mean_len, None) * batch
    step_mem = (weights + kv_read) / g.bandwidth
    step_flops = 2 * s.params / tp * batch / g.flops
    step = max(step_mem, step_flops) + p.step_overhead_s
    by_type = {"full_attention": {"layers": s.full_layers, "bytes_per_token": per_layer * s.full_layers}}
    if s.sliding_layers:
        by_type["sliding_window"] = {"layers": s.sliding_layers, "window": s.sliding_window,
                                     "bytes_per_token": per_layer * s.sliding_layers,
                                     "bytes_per_request_capped": per_layer * s.sliding_layers
                                     * min(total_len, s.sliding_window or total_len)}
    return {
        "model": s.name, "gpu": g.name, "tensor_parallel": tp, "weight_dtype": p.weight_dtype,
        "kv_dtype": p.kv_dtype, "params": s.params, "context_len": total_len, "block_size": p.block_size,
        "kv_bytes_per_token": per_layer * s.num_layers,
        "kv_bytes_per_token_by_layer_type": by_type,
        "kv_bytes_per_request": per_req_exact,
        "kv_gib_per_request": per_req_exact / GIB,
        "num_requests": p.num_requests,
        "kv_bytes_for_num_requests": per_req_exact * p.num_requests,
        "kv_gib_for_num_requests": per_req_exact * p.num_requests / GIB,
        "gpu_memory_bytes": g.memory_bytes, "memory_budget_bytes": budget, "weight_bytes": weights,
        "activation_bytes": act, "kv_memory_bytes": kv_memory, "kv_memory_gib": kv_memory / GIB,
        "fits": kv_memory > 0,
        "page_bytes": page, "num_blocks": kv_memory // page if page else 0,
        "max_concurrent_requests_paged": max_paged,
        "max_concurrent_requests_contiguous": max_contig,
        "fits_num_requests": max_paged >= p.num_requests,
        "decode_batch": batch, "decode_step_s": step,
        "decode_bound": "memory" if step_mem >= step_flops else "compute",
        "decode_tokens_per_s": batch / step,
    }


def format_plan(r: dict) -> str:
    gib = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
    rows = [
        ("model / GPU", f"{r['model']} on {r['gpu']} (TP {r['tensor_parallel']}), weights {r['weight_dtype']}, "
                        f"KV {r['kv_dtype']}"),
        ("parameters", f"{r['params'] / 1e9:,.2f} B ({gib(r['weight_bytes'])} per GPU)"),
        ("KV per token", f"{r['kv_bytes_per_token']:,} B"),
    ]
    for kind, d in r["kv_bytes_per_token_by_layer_type"].items():
        extra = f", window {d['window']}" if "window" in d else ""
        rows.append((f"  {kind}", f"{d['layers']} layers, {d['bytes_per_token']:,} B/token{extra}"))
    rows += [
        (f"KV per request ({r['context_len']:,} tok)", f"{r['kv_bytes_per_request']:,} B = {gib(r['kv_bytes_per_request'])}"),
        (f"KV for {r['num_requests']} requests", gib(r["kv_bytes_for_num_requests"])),
        ("memory for KV", f"{gib(r['kv_memory_bytes'])} (budget {gib(r['memory_budget_bytes'])} - weights - "
                          f"activations {gib(r['activation_bytes'])})"),
        ("blocks in pool", f"{r['num_blocks']:,} x {r['block_size']} tokens ({r['page_bytes']:,} B each)"),
        ("max concurrent (paged)", f"{r['max_concurrent_requests_paged']:,}"),
        ("max concurrent (contiguous)", f"{r['max_concurrent_requests_contiguous']:,}"),
        ("decode roofline", f"batch {r['decode_batch']}: {r['decode_step_s'] * 1e3:,.2f} ms/step, "
                            f"{r['decode_tokens_per_s']:,.0f} tok/s ({r['decode_bound']}-bound)"),
    ]
    if not r["fits"]:
        rows.append(("WARNING", "the weights do not leave room for any KV cache: raise TP or lower precision"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
