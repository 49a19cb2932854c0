"""Memory math: KV bytes per token and request, pool size, concurrency, decode roofline.

Hybrid models (sliding-window and full-attention layers) are also planned with the cache's own
layouts (``kvos.cache.layout``): homogeneous, equal pages and unified, side by side.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvos.cache.full_attention import cdiv
from kvos.cache.layout import LAYOUTS, CacheLayout, build_layout, with_draft_group
from kvos.cache.spec import CacheSpec, MambaStateSpec, default_cache_every
from kvos.sim.hardware import GIB, GPU, KV_DTYPES, WEIGHT_BYTES, kv_bytes_per_token
from kvos.sim.shapes import ModelShape

LAYOUT_ORDER = ("homogeneous", "equal_pages", "unified")
"""How the planner lists the layouts: no hybrid support, vLLM's, Jenga's (the engine's default)."""
assert set(LAYOUT_ORDER) == set(LAYOUTS)


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
    kv_cache_memory_bytes: int | None = None  # the KV pool's bytes, as the engine's option (default: estimated)
    draft: ModelShape | None = None  # a speculative draft model: its weights and its KV group count too
    images_per_request: int = 0
    """Images in each request: ``prompt_tokens_per_image`` each, added to ``context_len`` (a vision model only)."""
    encoder_cache_bytes: int = 0
    """The engine's encoder cache cap (``encoder_cache_mb``): pages of the KV pool that may hold
    image encodings; with ``images_per_request``, the plan counts it full (the KV memory left
    when it is)."""

    def __post_init__(self) -> None:
        if self.images_per_request and self.shape.vision is None:
            raise ValueError(f"images_per_request: model {self.shape.name} takes no images")
        if self.images_per_request < 0 or self.encoder_cache_bytes < 0:
            raise ValueError("images_per_request and encoder_cache_bytes must be >= 0")
        if self.weight_dtype not in WEIGHT_BYTES:
            raise ValueError(f"weight_dtype must be one of {sorted(WEIGHT_BYTES)}, got {self.weight_dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("context_len", "num_requests", "block_size", "tensor_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def kv_heads_per_gpu(shape: ModelShape, tp: int) -> int:
    """KV heads split over TP (replicated once TP exceeds them)."""
    return max(1, shape.num_kv_heads // tp)


def kv_per_layer_token(shape: ModelShape, kv_dtype: str, tp: int) -> int:
    """K and V of one token in one layer, on one GPU."""
    return kv_bytes_per_token(1, kv_heads_per_gpu(shape, tp), shape.head_dim, kv_dtype)


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a sliding layer group holds for one request in steady decode: the next
    token reads the ``window - 1`` tokens before it, which with the token itself can touch
    ``cdiv(window - 1, block_size) + 1`` blocks (``SlidingWindowManager.remove_skipped_blocks``
    frees the blocks before them). A prefill chunk holds up to the chunk's blocks more, briefly."""
    return cdiv(window - 1, block_size) + 1


STATE_PAGES_PER_REQUEST = 1
"""State pages a decoding request holds: one, plus a second during the one step in
``block_size`` that crosses a block boundary (it reads the state of one block and writes the
next, ``MambaStateManager``), which the planner leaves to the engine's preemption."""


def group_blocks(spec: CacheSpec, tokens: int) -> int:
    """Blocks one cache group holds for a request of ``tokens`` tokens (at its peak)."""
    if isinstance(spec, MambaStateSpec):
        return min(STATE_PAGES_PER_REQUEST, cdiv(tokens, spec.block_size))
    blocks = cdiv(tokens, spec.block_size)
    window = getattr(spec, "window", None)
    return blocks if window is None else min(blocks, window_blocks(window, spec.block_size))


def model_layout(shape: ModelShape, kv_dtype: str, block_size: int, mode: str, tp: int = 1,
                 cache_every: int | None = None) -> CacheLayout:
    """The cache layout the engine would build for ``shape`` on one GPU of a TP group (a Mamba
    model's state group with ``cache_every``, default the engine's ``mamba_cache_every``)."""
    state = None
    if shape.mamba is not None:
        m = shape.mamba
        state = MambaStateSpec(block_size, len(shape.mamba_layers), m.conv_dim, m.conv_width, m.num_heads,
                               m.head_dim, m.state_size)
        kv_block = kv_per_layer_token(shape, "fp16", tp) * shape.attention_layers * block_size
        every = cache_every or default_cache_every(state.page_bytes, kv_block)
        state = MambaStateSpec(**{**state.__dict__, "cache_every": every})
    return build_layout(shape.layer_windows(), block_size, kv_heads_per_gpu(shape, tp), shape.head_dim,
                        KV_DTYPES.get(kv_dtype, kv_dtype), mode, state, shape.mamba_layers)


def draft_layout(shape: ModelShape, draft: ModelShape, kv_dtype: str, block_size: int, mode: str,
                 tp: int = 1) -> CacheLayout:
    """The layout an engine with a speculative draft model builds: the target's groups plus the
    draft's own full-attention group (``with_draft_group``)."""
    return with_draft_group(model_layout(shape, kv_dtype, block_size, mode, tp), draft.num_layers,
                            kv_heads_per_gpu(draft, tp), draft.head_dim, KV_DTYPES.get(kv_dtype, kv_dtype))


def layout_capacity(layout: CacheLayout, tokens: int, kv_memory: int) -> dict:
    """How many requests of ``tokens`` tokens one pool of ``kv_memory`` bytes holds at once.

    Each group ``g`` holds ``group_blocks`` blocks per request; its small pages (blocks) are
    packed ``blocks_per_large_page(g)`` to a large page, shared by all of the group's requests
    (the block pool hands a group's free small pages to any request), so ``n`` requests take
    ``sum_g cdiv(n * blocks_g, per_g)`` large pages: the rounding is once per group, not per
    request. Page 0 holds the null blocks and is not usable. Exact integer math.
    """
    blocks = [group_blocks(g.spec, tokens) for g in layout.groups]
    per = [layout.blocks_per_large_page(g) for g in range(len(layout.groups))]
    page = layout.large_page_bytes
    num_pages = layout.num_pages_for_memory(kv_memory)
    usable = max(0, num_pages - 1)

    def pages_for(n: int) -> int:
        return sum(cdiv(n * b, p) for b, p in zip(blocks, per))

    lo, hi = 0, usable * max(per) + 1  # pages_for(hi) > usable: a request takes >= 1 block
    while hi - lo > 1:  # largest n with pages_for(n) <= usable
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pages_for(mid) <= usable else (lo, mid)
    n = lo
    allocated = pages_for(n) * page
    live = n * layout.live_bytes(tokens)
    per_request = sum(b * g.spec.page_bytes for b, g in zip(blocks, layout.groups))
    return {
        "kv_layout": layout.mode, "num_groups": len(layout.groups), "page_bytes": page,
        "num_pages": num_pages,
        "groups": [{**d, "blocks_per_request": b} for d, b in zip(layout.describe(), blocks)],
        "large_pages_per_request": per_request / page,
        "kv_bytes_per_request": per_request,
        "live_bytes_per_request": layout.live_bytes(tokens),
        "max_concurrent_requests": n,
        "allocated_bytes": allocated, "live_bytes": live,
        "waste_fraction": 1 - live / allocated if allocated else 0.0,
    }


def plan_layouts(shape: ModelShape, kv_dtype: str, block_size: int, tokens: int, kv_memory: int,
                 tp: int = 1) -> dict[str, dict]:
    """``layout_capacity`` of each layout, homogeneous first (a Mamba model has no equal-pages
    layout: its state pages are not a KV page's size)."""
    modes = [m for m in LAYOUT_ORDER if not (shape.mamba is not None and m == "equal_pages")]
    return {mode: layout_capacity(model_layout(shape, kv_dtype, block_size, mode, tp), tokens, kv_memory)
            for mode in modes}


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
            slide_blocks = min(slide_blocks, window_blocks(shape.sliding_window, block_size))
        slide = slide_blocks * block_size
    return per_layer * ((shape.full_layers - len(shape.mamba_layers)) * full + shape.sliding_layers * slide)


def plan(p: PlanInput) -> dict:
    s, g, tp = p.shape, p.gpu, p.tensor_parallel
    per_layer = kv_per_layer_token(s, p.kv_dtype, tp)
    image_tokens = p.images_per_request * s.vision.prompt_tokens_per_image if s.vision is not None else 0
    total_len = p.context_len + p.output_len + image_tokens
    mean_len = int(round(p.mean_len)) + image_tokens if p.mean_len else total_len
    weights = int(s.params * WEIGHT_BYTES[p.weight_dtype] / tp)
    d = p.draft
    draft_weights = int(d.params * WEIGHT_BYTES[p.weight_dtype] / tp) if d is not None else 0
    draft_per_token = kv_per_layer_token(d, p.kv_dtype, tp) * d.num_layers if d is not None else 0
    weights += draft_weights
    act = int(p.max_num_batched_tokens * (4 * s.hidden_size + 2 * s.intermediate_size // tp) * 2
              + 256 * s.vocab_size * 4 // tp)
    budget = int(g.memory_bytes * p.gpu_memory_utilization)
    encoder = p.encoder_cache_bytes if s.vision is not None and p.images_per_request else 0
    kv_memory = (max(0, budget - weights - act - encoder) if p.kv_cache_memory_bytes is None
                 else p.kv_cache_memory_bytes)
    state = s.state_bytes_per_request()
    per_req_exact = kv_bytes_for_len(s, per_layer, total_len, None) + draft_per_token * total_len + state
    contiguous_req = (per_layer * s.attention_layers + draft_per_token) * total_len + state  # Era 1: max length
    layouts = None
    if d is not None:  # the draft's group shares the pool: the cache's own layout sizes it
        paged = layout_capacity(draft_layout(s, d, p.kv_dtype, p.block_size, "unified", tp), mean_len, kv_memory)
        max_paged, page, num_pages = paged["max_concurrent_requests"], paged["page_bytes"], paged["num_pages"]
        if s.is_hybrid:
            layouts = plan_layouts(s, p.kv_dtype, p.block_size, total_len, kv_memory, tp)
    elif s.is_hybrid:  # paged = the engine's default layout (unified), from the cache's own layout
        layouts = plan_layouts(s, p.kv_dtype, p.block_size, total_len, kv_memory, tp)
        paged = (layouts["unified"] if mean_len == total_len else
                 layout_capacity(model_layout(s, p.kv_dtype, p.block_size, "unified", tp), mean_len, kv_memory))
        max_paged, page, num_pages = paged["max_concurrent_requests"], paged["page_bytes"], paged["num_pages"]
    else:
        per_req_paged = kv_bytes_for_len(s, per_layer, mean_len, p.block_size)
        page = per_layer * s.num_layers * p.block_size
        max_paged = kv_memory // per_req_paged if per_req_paged else 0
        num_pages = kv_memory // page if page else 0
    max_contig = kv_memory // contiguous_req if contiguous_req else 0
    batch = max(1, min(max_paged, 4096))
    kv_read = (kv_bytes_for_len(s, per_layer, mean_len, None) + 2 * state) * batch  # a state is read and written
    step_mem = (weights - draft_weights + kv_read) / g.bandwidth  # the target's plain decode step
    step_flops = 2 * s.params / tp * batch / g.flops
    step = max(step_mem, step_flops) + p.step_overhead_s
    attn_full = s.full_layers - len(s.mamba_layers)
    by_type = {"full_attention": {"layers": attn_full, "bytes_per_token": per_layer * attn_full}}
    if s.sliding_layers:
        by_type["sliding_window"] = {"layers": s.sliding_layers, "window": s.sliding_window,
                                     "bytes_per_token": per_layer * s.sliding_layers,
                                     "bytes_per_request_capped": per_layer * s.sliding_layers
                                     * min(total_len, s.sliding_window or total_len)}
    if s.mamba is not None:
        by_type["mamba_state"] = {"layers": len(s.mamba_layers), "bytes_per_token": 0, "bytes_per_request": state}
    out = {
        "model": s.name, "gpu": g.name, "tensor_parallel": tp, "weight_dtype": p.weight_dtype,
        "kv_dtype": p.kv_dtype, "params": s.params, "context_len": total_len, "block_size": p.block_size,
        "kv_bytes_per_token": per_layer * s.attention_layers + draft_per_token,
        "state_bytes_per_request": state,
        "kv_bytes_per_token_by_layer_type": by_type,
        "kv_bytes_per_request": per_req_exact,
        "kv_gib_per_request": per_req_exact / GIB,
        "num_requests": p.num_requests,
        "kv_bytes_for_num_requests": per_req_exact * p.num_requests,
        "kv_gib_for_num_requests": per_req_exact * p.num_requests / GIB,
        "gpu_memory_bytes": g.memory_bytes, "memory_budget_bytes": budget, "weight_bytes": weights,
        "activation_bytes": act, "kv_memory_bytes": kv_memory, "kv_memory_gib": kv_memory / GIB,
        "fits": kv_memory > 0,
        "page_bytes": page, "num_blocks": num_pages,
        "max_concurrent_requests_paged": max_paged,
        "max_concurrent_requests_contiguous": max_contig,
        "fits_num_requests": max_paged >= p.num_requests,
        "decode_batch": batch, "decode_step_s": step,
        "decode_bound": "memory" if step_mem >= step_flops else "compute",
        "decode_tokens_per_s": batch / step,
    }
    if s.vision is not None:
        out.update(images_per_request=p.images_per_request, image_tokens_per_request=image_tokens,
                   vision_params=s.vision.num_params(s.hidden_size), encoder_cache_bytes=encoder)
    if layouts is not None:
        out["kv_layouts"] = layouts
    if d is not None:
        out.update(draft_model=d.name, draft_kv_bytes_per_token=draft_per_token, draft_weight_bytes=draft_weights)
        by_type["draft"] = {"layers": d.num_layers, "bytes_per_token": draft_per_token}
    return out


def format_plan(r: dict) -> str:
    gib = lambda b: f"{b / GIB:,.2f} GiB"  # noqa: E731
    layouts = r.get("kv_layouts")
    rows = [
        ("model / GPU", f"{r['model']} on {r['gpu']} (TP {r['tensor_parallel']}), weights {r['weight_dtype']}, "
                        f"KV {r['kv_dtype']}"),
        ("parameters", f"{r['params'] / 1e9:,.2f} B ({gib(r['weight_bytes'])} per GPU"
                       f"{', the draft included' if 'draft_model' in r else ''})"),
        ("KV per token", f"{r['kv_bytes_per_token']:,} B"),
    ]
    if "vision_params" in r:
        rows.insert(2, ("images", f"{r['images_per_request']} per request = {r['image_tokens_per_request']:,} tokens "
                                  f"(in the context); encoder {r['vision_params'] / 1e6:,.0f} M parameters; encoder "
                                  f"cache up to {gib(r['encoder_cache_bytes'])} of the pool (counted full)"))
    if "draft_model" in r:
        rows.insert(2, ("draft model", f"{r['draft_model']}: {gib(r['draft_weight_bytes'])} of weights, "
                                       f"{r['draft_kv_bytes_per_token']:,} B/token of KV (its own cache group)"))
    if layouts:  # the unified layout's groups: one per kind of layer
        for g in layouts["unified"]["groups"]:
            if g["kind"] == "mamba_state":
                rows.append(("  mamba_state", f"{len(g['layers'])} layers, {gib(r['state_bytes_per_request'])} of "
                                              f"state per request (any length), pages of {g['page_bytes']:,} B"))
                continue
            extra = (f", window {g['window']:,} (holds <= {g['blocks_per_request']:,} blocks)"
                     if g["window"] is not None else "")
            rows.append((f"  {g['kind']}", f"{len(g['layers'])} layers, {g['bytes_per_token']:,} B/token{extra}"))
    else:
        for kind, d in r["kv_bytes_per_token_by_layer_type"].items():
            extra = f", window {d['window']}" if "window" in d else ""
            rows.append((f"  {kind}", f"{d['layers']} layers, {d['bytes_per_token']:,} B/token{extra}"))
    rows += [
        (f"KV per request ({r['context_len']:,} tok)", f"{r['kv_bytes_per_request']:,} B = {gib(r['kv_bytes_per_request'])}"),
        (f"KV for {r['num_requests']} requests", gib(r["kv_bytes_for_num_requests"])),
        ("memory for KV", f"{gib(r['kv_memory_bytes'])} (budget {gib(r['memory_budget_bytes'])} - weights - "
                          f"activations {gib(r['activation_bytes'])})"),
    ]
    if layouts or "draft_model" in r:
        rows += [("max concurrent (paged)", f"{r['max_concurrent_requests_paged']:,} (unified layout)")]
    else:
        rows += [("blocks in pool", f"{r['num_blocks']:,} x {r['block_size']} tokens ({r['page_bytes']:,} B each)"),
                 ("max concurrent (paged)", f"{r['max_concurrent_requests_paged']:,}")]
    rows += [
        ("max concurrent (contiguous)", f"{r['max_concurrent_requests_contiguous']:,}"),
        ("decode roofline", f"batch {r['decode_batch']}: {r['decode_step_s'] * 1e3:,.2f} ms/step, "
                            f"{r['decode_tokens_per_s']:,.0f} tok/s ({r['decode_bound']}-bound)"),
    ]
    if not r["fits"]:
        rows.append(("WARNING", "the weights do not leave room for any KV cache: raise TP or lower precision"))
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    if layouts:
        text += "\n\n" + format_layouts(layouts, r["context_len"], r["block_size"])
    return text


def _groups_text(lay: dict) -> tuple[str, str]:
    """(layer slots per group, blocks per request per group), runs of like groups folded."""
    runs: list[list] = []  # [kind, slots, blocks, count]
    for g in lay["groups"]:
        kind = "state" if g["kind"] == "mamba_state" else "full" if g["window"] is None else "sliding"
        key = [kind, len(g["layers"]) + g["padding_layers"],
               g["blocks_per_request"]]
        if runs and runs[-1][:3] == key:
            runs[-1][3] += 1
        else:
            runs.append(key + [1])
    pads = sum(g["padding_layers"] for g in lay["groups"])
    layers = " + ".join(f"{c} x {n} {k}" if c > 1 else f"{n} {k}" for k, n, _, c in runs)
    blocks = " + ".join(f"{c} x {b:,}" if c > 1 else f"{b:,}" for _, _, b, c in runs)
    return layers + (f" ({pads} pad)" if pads else ""), blocks


def format_layouts(layouts: dict[str, dict], tokens: int, block_size: int) -> str:
    """The three layouts side by side (``plan_layouts``)."""
    modes = list(layouts)
    cells = {m: _groups_text(layouts[m]) for m in modes}
    pct = lambda lay: "-" if not lay["max_concurrent_requests"] else f"{lay['waste_fraction']:.2%}"  # noqa: E731
    ppr = lambda x: f"{x:,.0f}" if x == int(x) else f"{x:,.2f}"  # noqa: E731
    table = [
        (f"KV layouts ({tokens:,} tok/request, {block_size}-token blocks)", modes),
        ("  cache groups (layers each)", [cells[m][0] for m in modes]),
        ("  blocks per request per group", [cells[m][1] for m in modes]),
        ("  page size (B)", [f"{layouts[m]['page_bytes']:,}" for m in modes]),
        ("  pages in pool", [f"{layouts[m]['num_pages']:,}" for m in modes]),
        ("  pages per request", [ppr(layouts[m]["large_pages_per_request"]) for m in modes]),
        ("  max concurrent requests", [f"{layouts[m]['max_concurrent_requests']:,}" for m in modes]),
        ("  KV waste at that load", [pct(layouts[m]) for m in modes]),
    ]
    width = max(len(k) for k, _ in table)
    cols = [max(len(v[i]) for _, v in table) for i in range(len(modes))]
    return "\n".join(f"{k:<{width}}" + "".join(f"  {v:>{c}}" for v, c in zip(vals, cols)) for k, vals in table)
