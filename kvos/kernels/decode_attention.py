"""Paged decode attention (one query token per sequence), split over the context."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvos.kernels import pdl
from kvos.kernels.pdl import wait_for_previous
from kvos.kernels.tile_attention import (
    LOG2E,
    V_FOLD,
    attend_key_range,
    check_paged_inputs,
    dot_precision,
    padded_head_dim,
    quantized_dot_flags,
    scale_args,
    v_pages,
)

MIN_KEYS_PER_SPLIT = 256
"""``decode_num_splits`` never gives a split fewer keys than this (counted on the padded table)."""

MAX_SPLITS = 64
"""Upper bound of ``decode_num_splits``. Callers may pass more, within reason: the combine
kernel holds all of a row's splits in registers."""


def decode_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      num_sms: int = 132, programs_per_sm: int = 2) -> int:
    """Default context splits from shapes only: enough programs (``batch * num_kv_heads *
    splits``) for about ``programs_per_sm`` programs per SM over ``num_sms`` SMs, each split
    still covering at least ``MIN_KEYS_PER_SPLIT`` of the ``max_blocks * block_size`` keys the
    block table can address.

    Rounded down to a power of two: the split count is a compile-time constant of the kernels, so
    eager steps of ever-changing batch composition reuse the at most seven variants that the
    engine's CUDA-graph capture has already compiled, instead of stalling to compile new ones."""
    wanted = triton.cdiv(programs_per_sm * num_sms, max(1, batch * num_kv_heads))
    by_length = max_blocks * block_size // MIN_KEYS_PER_SPLIT
    splits = max(1, min(wanted, by_length, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


class DecodeTiles(NamedTuple):
    """Launch shape of the split kernel: keys per tile, warps, pipeline stages, the programs per SM
    that ``decode_num_splits`` aims for, and a register cap per thread (None: the compiler's
    choice; the engine sets none, the probes in ``benchmarks/scripts`` sweep it)."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    max_registers: int | None = None


QUANTIZED_TILES = DecodeTiles(32, 1, 3, 8)
"""The 8-bit kernel's launch shape at head_dim 128 with 16-bit queries: 32 keys per tile (two
blocks of 16), one warp, three stages, splits for about 8 programs per SM. H200, Llama-3.1-8B
heads, fp8 with V token-minor, one layer inside a CUDA graph, against the shape before (128 keys,
4 warps, 5 stages, 4 per SM; ``benchmarks/results/decode-tiles-h200.jsonl``): 256 x 256 keys
0.100 -> 0.045 ms (bf16 0.075), 256 x 512 0.134 -> 0.075 (bf16 0.138), 64 x 512 0.058 -> 0.027,
1 x 2K 0.022 -> 0.009, 64 x 8K 0.33 -> 0.28, 256 x 8K 1.14 -> 0.97, 64 x 32K 1.19 -> 1.04,
256 x 32K 4.34 -> 3.91. Small programs keep many in flight per SM, which is what hides the
latency of the gathered, converted tiles; larger tiles only pay off where the context is long."""


HALF_TILES = DecodeTiles(64, 2, 3, 4)
"""The 16-bit kernel's launch shape at head_dim 128: 64 keys per tile, two warps, three stages,
splits for about 4 programs per SM. H200, Llama-3.1-8B heads, bf16, one layer inside a CUDA
graph, against the shape before (64 keys, 4 warps, 2 stages, 2 per SM;
``benchmarks/results/decode-tiles-bf16-h200.jsonl``), ms: 32 x 512 keys 0.0258 -> 0.0237,
64 x 512 0.0420 -> 0.0444, 128 x 512 0.0741 -> 0.0708, 256 x 512 0.139 -> 0.132, 32 x 2K
0.073 -> 0.070, 256 x 2K 0.531 -> 0.479, 64 x 8K 0.506 -> 0.489, 256 x 8K 2.08 -> 1.84, 64 x
32K 2.04 -> 1.91 (random tables over 36,000 blocks: long contexts reread blocks, partly from L2)."""


def decode_tiles(head_dim_pad: int, dtype: torch.dtype, quantized: bool) -> DecodeTiles:
    """The split kernel's launch shape. Keys per tile: 64, or 32 for 256-wide heads so
    double-buffered K/V tiles stay small. 16-bit caches: ``HALF_TILES`` at head_dim 128;
    otherwise two stages and two programs per SM. 8-bit caches: ``QUANTIZED_TILES`` at head_dim 128 with
    16-bit queries; otherwise twice the 16-bit keys per tile (the same bytes per tile) and three
    stages. Every choice is the best of a sweep (H100: ``benchmarks/scripts/sweep_quant_tiles.py``;
    H200: the probes in ``QUANTIZED_TILES`` and ``HALF_TILES``)."""
    block_n = 32 if head_dim_pad >= 256 else 64
    if quantized:
        if head_dim_pad == 128 and dtype != torch.float32:
            return QUANTIZED_TILES
        return DecodeTiles(2 * block_n, 4, 3, 2)
    if head_dim_pad == 128 and dtype in (torch.bfloat16, torch.float16):
        return HALF_TILES
    return DecodeTiles(block_n, 8 if dtype == torch.float32 else 4, 2, 2)


@triton.jit(do_not_specialize=["stride_tb", "window"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "k_scale_ptr",
                                            "v_scale_ptr"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ob, stride_oh, stride_od,
    stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    num_heads, group, window,
    NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr,
    DOT_FP16: tl.constexpr, INT8_FP16: tl.constexpr, V_PAGES: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (b, kv head, split): the group's query heads over one slice of the context.

    The context is ``lo .. seq_len-1`` with ``lo = 0``, or ``max(0, seq_len - window)`` when
    HAS_WINDOW (sliding window: the last ``window`` keys). It is cut into NUM_SPLITS slices of
    ``cdiv(seq_len - lo, NUM_SPLITS)`` keys rounded up to BLOCK_N, so late splits of a short
    context are empty; keys below ``lo`` are never read (but for V_PAGES, below). With one split
    the result goes straight to ``out``; otherwise each split writes its normalised partial
    output and its log2-sum-exp (``-inf`` for an empty split) for ``_decode_combine_kernel``.

    QUANT: the caches are fp8 / int8 with float32 scales at ``k_scale_ptr`` / ``v_scale_ptr``
    (``attend_key_range`` dequantizes); otherwise those arguments are never read.

    V_PAGES (a token-minor V cache, ``v_pages``): the slices start on block boundaries. With a
    window they are cut from ``lo`` rounded down to its block, and the keys before ``lo`` in that
    block are read and hidden (every range masked per row), so they must hold finite values and
    scales, as every position below a sequence's length does.
    """
    wait_for_previous(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    base = lo
    if V_PAGES:
        base = lo // BLOCK_SIZE * BLOCK_SIZE
    # With V_PAGES and a window, keys base .. lo-1 are read: every range masks per row.
    HIDE: tl.constexpr = HAS_WINDOW and V_PAGES
    keys_per_split = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = tl.minimum(base + split * keys_per_split, seq_len)
    end = tl.minimum(start + keys_per_split, seq_len)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * group + offs_g
    mask_gd = (offs_g < group)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_gd, other=0.0)
    if DOT_FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    row_last = tl.full([BLOCK_G], 0, dtype=tl.int32) + (end - 1)
    row_first = tl.full([BLOCK_G], 0, dtype=tl.int32) + lo
    k_head_ptr = k_cache_ptr + kvh * stride_kh
    v_head_ptr = v_cache_ptr + kvh * stride_vh
    table_ptr = block_tables_ptr + b * stride_tb
    ks_head_ptr = k_scale_ptr + kvh * stride_ksh
    vs_head_ptr = v_scale_ptr + kvh * stride_vsh
    # Without HIDE every key of the slice is visible to the query: no lower-bound mask.
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, row_first, row_last, start, full_end, k_head_ptr, v_head_ptr, table_ptr,
        stride_tn, stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
        ks_head_ptr, vs_head_ptr, stride_ksb, stride_kso, stride_vsb, stride_vso, scale_log2,
        BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, PRECISION, HIDE, HIDE, QUANT, INT8_FP16, V_PAGES)
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, row_first, row_last, full_end, end, k_head_ptr, v_head_ptr, table_ptr,
        stride_tn, stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
        ks_head_ptr, vs_head_ptr, stride_ksb, stride_kso, stride_vsb, stride_vso, scale_log2,
        BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, PRECISION, True, HIDE, QUANT, INT8_FP16, V_PAGES)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    if QUANT:
        o = o * (1.0 / V_FOLD)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=mask_gd)
    else:
        row = (b * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_gd)
        lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=offs_g < group)


@triton.jit
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    num_heads,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (b, head): merge the splits' partial outputs, weighted by exp2(lse - max lse).
    Empty splits (lse = -inf) weigh 0; a row whose splits are all empty gets zeros."""
    wait_for_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    row = (b * num_heads + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None,
                           num_splits: int | None = None,
                           window: int | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (flash-decoding).

    q: ``[B, H, D]`` (any strides), the query of each sequence's last token, whose K/V is already
    in the cache. k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``, same dtype as q (unless
    quantized: see k_scale), any strides. Query head h reads kv head ``h // (H // KVH)``. A
    token-minor V cache (``v_cache.stride(1) == 1``, as the engine stores 8-bit caches) is read a
    block at a time (``tile_attention.v_pages``).
    block_tables: ``[B, max_blocks]`` int32/int64; entries past a sequence's last block are never
    read. seq_lens: ``[B]`` int, tokens including the new one; sequence b attends keys ``lo ..
    seq_lens[b]-1``. A row with seq_len 0 (padding) gets zeros. scale: softmax scale. out:
    ``[B, H, D]`` in q's dtype (any strides), allocated if None; returned.

    window: sliding-window size of this layer, the same for every sequence; None or 0 means full
    causal attention (``lo = 0``). Otherwise ``lo = max(0, seq_len - window)``: the token at
    position ``p = seq_len - 1`` sees keys ``p - window < j <= p`` (Gemma 3 / Mistral sliding
    window), and only those are read (and, for a token-minor V cache, the ones before them in
    ``lo``'s block), so table entries of blocks wholly before ``lo`` may be anything (e.g. a null
    block 0). Passed as a runtime int: every window shares one compiled variant, and full
    attention compiles as without the option.

    k_scale, v_scale: quantized caches (``kvos.kernels.kv_quant``), both or neither: float32
    ``[num_blocks, block_size, KVH]`` (any strides), the scale of each (token, kv head) row, at
    the same block and offset as the row; k_cache and v_cache are then both float8_e4m3fn or
    both int8 (as ``write_kv`` writes them) and q is fp32, bf16 or fp16. Attention runs over the
    dequantized rows ``x * scale`` without a dequantized copy (``attend_key_range`` states how;
    16-bit queries take fp16 dots: ``quantized_dot_flags``). Scales are read exactly where the
    caches are: never past ``seq_len`` nor in blocks wholly before ``lo`` (which may hold anything), and the rows that are read must hold
    finite values and scales (as ``write_kv`` leaves them). Without scales the kernel compiles
    as before (a QUANT=False constexpr).

    num_splits: context slices per sequence (default ``decode_num_splits`` from the shapes, with
    the table capped at ``window`` keys). The grid is ``(B, KVH, num_splits)`` and each program
    takes ``cdiv(seq_len - lo, num_splits)`` keys (rounded up to a tile), so every value gives
    the same result up to rounding. With more than one split, a second kernel merges fp32
    partials ``[B, H, num_splits, D]`` and log-sum-exps ``[B, H, num_splits]``, allocated here
    with ``torch.empty``.

    CUDA graphs: no host synchronisation and no branch on tensor values; launch shapes depend only
    on ``q.shape``, ``block_tables.shape``, num_splits and window (and the kernel variant on
    whether scales are given). The workspace comes from torch's caching allocator, which during
    capture serves it from the graph's private pool, so capture works.
    """
    group = check_paged_inputs(q, k_cache, v_cache, block_tables, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert block_tables.shape[0] == batch and seq_lens.shape == (batch,)
    assert window is None or window >= 0
    max_blocks = block_tables.shape[1]
    if window:
        max_blocks = min(max_blocks, triton.cdiv(window, block_size))
    block_d = padded_head_dim(head_dim)
    tiles = decode_tiles(block_d, q.dtype, k_scale is not None)
    if k_scale is not None and tiles.block_n < block_size <= 128 and block_size & (block_size - 1) == 0:
        tiles = tiles._replace(block_n=block_size)  # whole blocks per tile, so v_pages holds
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_blocks, block_size,
                                       programs_per_sm=tiles.programs_per_sm)
    assert num_splits >= 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype
    if batch == 0:
        return out
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes straight to out
    scales = scale_args(k_cache, k_scale, v_scale)
    dot_fp16, int8_fp16 = quantized_dot_flags(q, k_cache, k_scale is not None)
    launch = {"maxnreg": tiles.max_registers} if tiles.max_registers else {}
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, *scales[:2],
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *scales[2:], num_heads, group, window or 0,
        NUM_SPLITS=num_splits, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n,
        BLOCK_D=block_d, HEAD_DIM=head_dim, PRECISION=dot_precision(q.dtype),
        HAS_WINDOW=bool(window), QUANT=k_scale is not None, DOT_FP16=dot_fp16, INT8_FP16=int8_fp16,
        V_PAGES=v_pages(v_cache, tiles.block_n),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch, **pdl.launch_args(q),
    )
    if num_splits > 1:
        _decode_combine_kernel[(batch, num_heads)](
            part_out, part_lse, out, *out.stride(), num_heads,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            HEAD_DIM=head_dim, num_warps=4, **pdl.launch_args(q),
        )
    return out
