"""Paged causal attention for a varlen batch of new tokens (prefill chunks, mixed with decodes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvos.kernels.dequantize_pages import dequantize_pages, dequantized_pages_bytes
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

DEQUANTIZE_MIN_QUERY = 512
"""Over an 8-bit cache, a batch whose longest chunk has at least this many new tokens (and no
window) attends over a dequantized copy of its context (``dequantize_pages``) with the 16-bit
kernel: each key is then converted once instead of once per query tile. H200, Llama-3.1-8B
heads, 16K context (``benchmarks/scripts/prefill_dequantized.py``): 1.31x faster at 512 new
tokens, 1.52-1.60x at 2,048-8,192, even at 128-256; at 256 over a 1K context the extra launch
makes it 0.67x."""

DEQUANTIZE_MAX_BYTES = 256 << 20
"""The largest such copy (K and V, all sequences of the batch); a larger context attends over
the 8-bit cache directly."""


def prefill_tiles(head_dim: int, group: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_Q query tokens, BLOCK_N keys, num_warps) per program.

    A program's tile has BLOCK_Q tokens times the group's query heads (padded to a power of two)
    as rows: 64 rows for bf16/fp16 with 64 keys (32 for 256-wide heads), 4 warps (8 for 256).
    fp32 (exact "ieee" dots on CUDA cores, a testing path) takes 32 rows, 8 warps and
    ``4096 // head_dim`` keys (at most 64), which keeps register spills small.
    """
    head_dim_pad = padded_head_dim(head_dim)
    if dtype == torch.float32:
        block_m, block_n, num_warps = 32, min(64, 4096 // head_dim_pad), 8
    else:
        block_m, block_n = 64, 64 if head_dim_pad <= 128 else 32
        num_warps = 8 if head_dim_pad >= 256 else 4
    return max(1, block_m // triton.next_power_of_2(group)), block_n, num_warps


def quantized_prefill_tiles(block_n: int, num_warps: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) over an 8-bit cache, from the 16-bit choice: 128 keys and
    three stages for heads up to 128 wide (the best of a sweep on an H100, at 0.74-0.79x of the
    bf16 cache's speed: each K/V tile is converted to q's dtype in registers before the dot);
    wider heads keep the 16-bit tiles (shared memory)."""
    if block_n >= 64 and num_warps == 4:
        return 128, 4, 3
    return block_n, num_warps, 2


@triton.jit(do_not_specialize=["stride_tb", "window"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr",
                                            "k_scale_ptr", "v_scale_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_od,
    stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    group, window,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr,
    DOT_FP16: tl.constexpr, INT8_FP16: tl.constexpr, V_PAGES: tl.constexpr,
):
    """Program (query tile, sequence, kv head): BLOCK_Q new tokens x the group's query heads.

    Row r is token ``r // GROUP_PAD`` of the tile and query head ``kvh * group + r % GROUP_PAD``.
    Key tiles entirely at or below the tile's first position run unmasked; the rest, up to the
    tile's last position, are masked causally per row. Tile indices run from the last (the most
    keys) down, so the longest programs start first; tiles past a sequence's length exit at once.

    HAS_WINDOW (sliding window): the row at position p sees keys ``p - window + 1 .. p``. Keys
    start at ``lo``, the first one the tile's first row sees; whole BLOCK_N tiles visible to every
    row of the tile (from the last row's first key up to the first row's position) run unmasked,
    the keys before and after them masked on both sides per row. Keys below ``lo`` are never read.

    QUANT: the caches are fp8 / int8 with float32 scales at ``k_scale_ptr`` / ``v_scale_ptr``
    (``attend_key_range`` dequantizes); otherwise those arguments are never read.

    V_PAGES (a token-minor V cache, ``v_pages``): the ranges that start on a multiple of BLOCK_N
    (all of them without a window; the unmasked one with) read V a block at a time.
    """
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_pos = seq_len - q_len + tile * BLOCK_Q
    end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N

    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tile * BLOCK_Q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    heads = kvh * group + g
    rows = q_start + tok
    mask_md = ((tok < q_len) & (g < group))[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=mask_md, other=0.0)
    if DOT_FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    row_last = first_pos + offs_m // GROUP_PAD
    k_head_ptr = k_cache_ptr + kvh * stride_kh
    v_head_ptr = v_cache_ptr + kvh * stride_vh
    table_ptr = block_tables_ptr + seq * stride_tb
    ks_head_ptr = k_scale_ptr + kvh * stride_ksh
    vs_head_ptr = v_scale_ptr + kvh * stride_vsh
    row_first = row_last  # the rows' first visible keys: unused without a window
    full_start = 0
    masked_start = full_end
    if HAS_WINDOW:
        row_first = row_last - window + 1
        lo = tl.maximum(first_pos - window + 1, 0)
        # Whole tiles from the last row's first key (end - window) up to full_end, visible to all
        # rows; none (full_start = full_end) when the rows share fewer keys than that.
        full_start = tl.minimum(tl.cdiv(tl.maximum(end - window, 0), BLOCK_N) * BLOCK_N, full_end)
        masked_start = tl.maximum(full_end, lo)
        # lo <= full_start, or else full_start = full_end < lo = masked_start: either way the
        # three ranges below cover lo .. end-1 once.
        acc, m_i, l_i = attend_key_range(
            acc, m_i, l_i, q, row_first, row_last, lo, tl.maximum(full_start, lo), k_head_ptr,
            v_head_ptr, table_ptr, stride_tn, stride_kb, stride_ko, stride_kd, stride_vb,
            stride_vo, stride_vd, ks_head_ptr, vs_head_ptr, stride_ksb, stride_kso, stride_vsb,
            stride_vso, scale_log2,
            BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, PRECISION, True, True, QUANT, INT8_FP16)
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, row_first, row_last, full_start, full_end, k_head_ptr, v_head_ptr,
        table_ptr, stride_tn, stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
        ks_head_ptr, vs_head_ptr, stride_ksb, stride_kso, stride_vsb, stride_vso,
        scale_log2, BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, PRECISION, False, False, QUANT, INT8_FP16,
        V_PAGES)
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, row_first, row_last, masked_start, end, k_head_ptr, v_head_ptr,
        table_ptr, stride_tn, stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
        ks_head_ptr, vs_head_ptr, stride_ksb, stride_kso, stride_vsb, stride_vso,
        scale_log2, BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, PRECISION, True, HAS_WINDOW, QUANT, INT8_FP16,
        V_PAGES and not HAS_WINDOW)

    if HAS_WINDOW:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows past q_len may see no key: no 0 / 0
    o = acc / l_i[:, None]
    if QUANT:
        o = o * (1.0 / V_FOLD)
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=mask_md)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            out: torch.Tensor | None = None,
                            window: int | None = None,
                            k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            max_seq_len: int | None = None,
                            dequantize_min_query: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    q: ``[T, H, D]`` (any strides), the new tokens of S sequences concatenated: sequence s owns
    rows ``query_start_loc[s] .. query_start_loc[s+1]-1`` (``query_start_loc``: ``[S+1]`` int,
    non-decreasing, starting at 0). seq_lens: ``[S]`` int, cached prefix plus new tokens, at least
    the sequence's query length; new token i of sequence s sits at position
    ``seq_lens[s] - q_len_s + i`` and attends keys ``0 ..`` that position (but see window). Every
    new token's K/V must already be in the cache (write it first with ``write_kv``). k_cache,
    v_cache: ``[num_blocks, block_size, KVH, D]``, q's dtype (unless quantized: see k_scale), any
    strides; query head h reads kv head ``h // (H // KVH)``. block_tables: ``[S, max_blocks]``
    int32/int64; entries past a sequence's last block are never read. max_query_len: an upper
    bound on every q_len (it sizes the grid; a larger bound only adds programs that exit at once).
    A sequence with q_len 1 is a decode, so one call can serve a mixed batch. out: ``[T, H, D]``
    in q's dtype (any strides), allocated if None; returned. Rows of q not owned by any sequence
    are left untouched.

    window: sliding-window size of this layer, the same for every sequence; None or 0 means full
    causal attention. Otherwise the token at position p attends keys ``p - window < j <= p``
    (Gemma 3 / Mistral sliding window), and a tile of new tokens reads only keys from its first
    token's ``p - window + 1`` on, so table entries of blocks wholly before the window of a
    sequence's first new token may be anything (e.g. a null block 0). Passed as a runtime int:
    every window shares one compiled variant, and full attention compiles as without the option.

    k_scale, v_scale: quantized caches (``kvos.kernels.kv_quant``), both or neither: float32
    ``[num_blocks, block_size, KVH]`` (any strides), the scale of each (token, kv head) row, at
    the same block and offset as the row; k_cache and v_cache are then both float8_e4m3fn or
    both int8 (as ``write_kv`` writes them) and q is fp32, bf16 or fp16. Attention runs over the
    dequantized rows ``x * scale`` without a dequantized copy (``attend_key_range`` states how;
    16-bit queries take fp16 dots: ``quantized_dot_flags``). Scales are read exactly where the
    caches are: never past a sequence's length nor in blocks wholly before the window, and the rows that are read must hold
    finite values and scales (as ``write_kv`` leaves them). Without scales the kernel compiles
    as before (a QUANT=False constexpr).

    max_seq_len: a host-side bound on every ``seq_lens[s]`` (None: unknown). With it, a quantized
    cache, no window and ``max_query_len >= dequantize_min_query`` (None: the module's
    ``DEQUANTIZE_MIN_QUERY`` at call time), the sequences' contexts are
    first dequantized into a scratch cache in q's dtype (``dequantize_pages``, at most
    ``DEQUANTIZE_MAX_BYTES``, freed on return) and the unquantized kernel attends over it: the
    result equals the unquantized kernel's over ``kv_quant.dequantize`` of the cache, which
    differs from the 8-bit path's by rounding only (the keys and values rounded to q's dtype,
    the probabilities to q's dtype rather than fp16).

    CUDA graphs: no host synchronisation and no branch on tensor values; the grid depends on
    max_query_len, S and KVH only.
    """
    group = check_paged_inputs(q, k_cache, v_cache, block_tables, k_scale, v_scale)
    num_seqs = seq_lens.shape[0]
    head_dim = q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert block_tables.shape[0] == num_seqs and query_start_loc.shape == (num_seqs + 1,)
    assert window is None or window >= 0
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype
    if num_seqs == 0 or max_query_len <= 0:
        return out
    min_query = DEQUANTIZE_MIN_QUERY if dequantize_min_query is None else dequantize_min_query
    if (k_scale is not None and not window and max_seq_len is not None and max_query_len >= min_query
            and dequantized_pages_bytes(num_seqs, max_seq_len, k_cache, q.dtype) <= DEQUANTIZE_MAX_BYTES):
        k_cache, v_cache, block_tables = dequantize_pages(k_cache, v_cache, k_scale, v_scale, block_tables,
                                                          seq_lens, max_seq_len, q.dtype)
        k_scale = v_scale = None
    block_q, block_n, num_warps = prefill_tiles(head_dim, group, q.dtype)
    num_stages = 2
    if k_scale is not None:
        block_n, num_warps, num_stages = quantized_prefill_tiles(block_n, num_warps)
    scales = scale_args(k_cache, k_scale, v_scale)
    dot_fp16, int8_fp16 = quantized_dot_flags(q, k_cache, k_scale is not None)
    _prefill_kernel[(triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, *scales[:2],
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *scales[2:], group, window or 0,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_N=block_n, BLOCK_D=padded_head_dim(head_dim), HEAD_DIM=head_dim,
        PRECISION=dot_precision(q.dtype), HAS_WINDOW=bool(window), QUANT=k_scale is not None,
        DOT_FP16=dot_fp16, INT8_FP16=int8_fp16, V_PAGES=v_pages(v_cache, block_n),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
