"""The inner loop shared by the paged attention kernels: online softmax over a range of keys
gathered through a block table, plus the host-side choices both wrappers make the same way (and,
under Triton's CPU interpreter only, a fix that lets it run these kernels)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvos.kernels.kv_quant import kv_dtype_of

LOG2E = 1.4426950408889634
"""Scores are scaled by ``scale * LOG2E`` so the softmax can use exp2."""


def _interpreter_index_fix() -> None:
    """Let Triton's CPU interpreter (TRITON_INTERPRET=1, used for testing) take the kernels'
    data-dependent loop bounds: Triton 3.6 converts a bound with ``int(array)``, which NumPy >= 2.4
    refuses for the 1-element arrays holding its scalars (triton-lang/triton#9171)."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "kvos_index_fix", False):
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.kvos_index_fix = True
    interpreter._patch_lang_tensor = patched


if triton.knobs.runtime.interpret:
    _interpreter_index_fix()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 ("ieee") for fp32 inputs, so results match a
    float64 reference to ~1e-6; bf16/fp16 inputs use the tensor cores at their own precision."""
    return "ieee" if dtype == torch.float32 else "tf32"


def padded_head_dim(head_dim: int) -> int:
    """The head dimension as a tile width: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> int:
    """Validate shapes shared by the attention wrappers; return the GQA group size H // KVH.

    Without scales the caches share q's dtype. With ``k_scale`` and ``v_scale`` (both or neither)
    the caches are quantized (``kvos.kernels.kv_quant``: both float8_e4m3fn or both int8) and the
    scales are float32 ``[num_blocks, block_size, KVH]``, any strides."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches: [blocks, block_size, KVH, D]"
    assert k_cache.shape[3] == head_dim, "q and the caches disagree on head_dim"
    assert (k_scale is None) == (v_scale is None), "pass both k_scale and v_scale, or neither"
    if k_scale is None:
        assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
    else:
        assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), "q: fp32, bf16 or fp16"
        assert k_cache.dtype == v_cache.dtype and kv_dtype_of(k_cache.dtype) is not None, \
            "scaled caches must both be float8_e4m3fn or both int8"
        for s in (k_scale, v_scale):
            assert s.dtype == torch.float32 and s.shape == k_cache.shape[:3], \
                "scales: float32 [blocks, block_size, KVH]"
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_tables.dim() == 2 and not block_tables.is_floating_point()
    return num_heads // num_kv_heads


def scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple:
    """The kernels' scale arguments: ``(k_scale, v_scale, *k_scale.stride(), *v_scale.stride())``,
    or without scales k_cache twice as a never-read stand-in and zero strides (QUANT=False)."""
    if k_scale is None:
        return (k_cache, k_cache) + (0,) * 6
    return (k_scale, v_scale, *k_scale.stride(), *v_scale.stride())


V_FOLD: tl.constexpr = tl.constexpr(256.0)
"""Power of two folded into ``p * v_scale`` over a quantized cache (exact; divided out at the end)."""


def v_pages(v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether ``attend_key_range`` can gather V a page at a time (its V_PAGES): the V cache is
    token-minor (``v_cache.stride(1) == 1``: within a block, one head's rows lie as
    ``[head_dim, block_size]``, as the engine stores 8-bit caches) and a tile of ``block_n`` keys
    covers whole blocks. The ranges passed with V_PAGES must start on a block boundary."""
    block_size = v_cache.shape[1]
    return block_size > 1 and v_cache.stride(1) == 1 and block_n % block_size == 0


def quantized_dot_flags(q: torch.Tensor, k_cache: torch.Tensor, quantized: bool) -> tuple[bool, bool]:
    """(DOT_FP16, INT8_FP16) constexprs of the kernels over an 8-bit cache. DOT_FP16: a 16-bit
    query is clamped to fp16's range and cast to fp16, the dots' operand dtype, because fp8 e4m3
    widens to fp16 in one instruction per pair and int8 by a bit trick, where bf16 takes several
    (on an H100 the conversion, not HBM, bounds the 8-bit decode kernel); fp32 queries (the exact
    testing path) stay fp32. INT8_FP16: int8 tiles widen to fp16 by the bits ``0x6480 + x``, which
    are ``1152 + x`` for every x in -128..127 (ulp 1 in [1024, 2048)): one add and one subtract
    (a decode kernel at 1.45x bf16's speed where ``.to`` gives 1.22x)."""
    dot_fp16 = quantized and q.dtype != torch.float32
    return dot_fp16, dot_fp16 and k_cache.dtype == torch.int8


@triton.jit
def int8_to_fp16(x):
    """An int8 tile as fp16, exactly, by the bit trick of ``quantized_dot_flags``."""
    return (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - tl.full(x.shape, 1152.0, tl.float16)


@triton.jit
def load_value_pages(v_head_ptr, table_ptr, stride_table, stride_vb, stride_vo, stride_vd, n, first,
                     end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):
    """Values of keys ``n .. n + BLOCK_N - 1`` as ``[BLOCK_N, BLOCK_D]``, gathered as
    ``BLOCK_N // BLOCK_SIZE`` whole blocks of a token-minor cache (``v_pages``), each block's
    rows contiguous along the keys, so the loads are vectors. ``n`` must be a multiple of
    BLOCK_SIZE. MASKED: blocks holding no key of ``first .. end-1`` are not read (nor their table
    entries); in the blocks that are, the rows outside that range are read (they exist but may
    hold anything) and set to 0. Columns past HEAD_DIM are 0."""
    PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
    offs_p = tl.arange(0, PAGES)
    offs_o = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM)[None, None, :]
    page_first = n + offs_p * BLOCK_SIZE
    if MASKED:
        used = (page_first < end) & (page_first + BLOCK_SIZE > first)
        page = tl.load(table_ptr + (n // BLOCK_SIZE + offs_p) * stride_table, mask=used, other=0)
        mask = mask & used[:, None, None]
    else:
        page = tl.load(table_ptr + (n // BLOCK_SIZE + offs_p) * stride_table)
    v = tl.load(v_head_ptr + (page.to(tl.int64) * stride_vb)[:, None, None]
                + (offs_o * stride_vo)[None, :, None] + (offs_d * stride_vd)[None, None, :],
                mask=mask, other=0.0)
    if MASKED:
        pos = page_first[:, None] + offs_o[None, :]
        v = tl.where(((pos >= first) & (pos < end))[:, :, None], v, 0.0)
    return tl.reshape(v, (BLOCK_N, BLOCK_D))


@triton.jit
def attend_key_range(
    acc, m_i, l_i, q, row_first, row_last, start, end,
    k_head_ptr, v_head_ptr, table_ptr, stride_table,
    stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
    k_scale_head_ptr, v_scale_head_ptr, stride_ksb, stride_kso, stride_vsb, stride_vso,
    scale_log2,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr,
    WINDOWED: tl.constexpr, QUANT: tl.constexpr, INT8_FP16: tl.constexpr = False,
    V_PAGES: tl.constexpr = False,
):
    """Fold keys at positions ``start .. end-1`` of one sequence into the softmax state.

    q: ``[M, BLOCK_D]`` query rows (zero-padded); acc ``[M, BLOCK_D]`` fp32, m_i / l_i ``[M]`` fp32:
    the running unnormalised output, max and sum in the log2 domain. Key position p lives in
    block ``table[p // BLOCK_SIZE]`` at offset ``p % BLOCK_SIZE``; ``k_head_ptr`` / ``v_head_ptr``
    already point at this kv head. Keys are gathered BLOCK_N at a time, across page boundaries.

    Only positions ``start .. end-1`` are read, from the table and from the caches.

    MASKED=False: every key in range is valid for every row and ``end - start`` is a multiple of
    BLOCK_N. MASKED=True: loads past ``end`` are masked and row r only sees keys
    ``<= row_last[r]``; keys past ``end`` must be hidden by that too (``end`` is at most
    ``row_last + 1`` of every row: the causal tail of a context). In both cases the first key of
    the range must be visible to every row that has seen no key yet, so a row's max is finite from
    its first tile on (no ``-inf - -inf``); row_first is ignored.

    WINDOWED=True (sliding window; with MASKED only) drops both requirements, at the cost of a
    few selects per tile: row r sees the keys ``row_first[r] .. row_last[r]`` of the range and no
    others, and a row that sees no key (in a tile or in the whole range) keeps ``m_i = -inf``,
    ``l_i = 0``.

    QUANT=True (quantized cache, ``kvos.kernels.kv_quant``): the caches hold fp8 e4m3 / int8 values
    and ``k_scale_head_ptr`` / ``v_scale_head_ptr`` point at this kv head's float32 scales, key
    position p's K scale at ``block * stride_ksb + offset * stride_kso`` (V: stride_vsb,
    stride_vso). q is fp32, or fp16 for 16-bit queries (``quantized_dot_flags``). A tile is
    converted to q's dtype (exact for both formats; INT8_FP16: by the bit trick), the keys' scales multiply
    the score columns (``s = (q @ k^T) * k_scale``, before the masking, so a hidden key stays -inf
    whatever its scale) and the values' scales the probabilities, times ``V_FOLD`` so that fp16
    products stay clear of fp16's subnormals (``acc += (p * v_scale * V_FOLD) @ v``; the caller
    divides the output by V_FOLD): attention over the dequantized cache ``x * scale`` without a
    dequantized copy of either tile. Scales are read at exactly the positions the caches are (loads past
    ``end`` are masked, to 0), so, as without quantization, the rows in range must hold finite
    values and scales: a hidden key's p is 0, but 0 times NaN is NaN. QUANT=False: the scale
    arguments are never read.

    V_PAGES=True (``v_pages``: a token-minor V cache; ``start`` a multiple of BLOCK_SIZE): V is
    read by ``load_value_pages``, whole blocks at a time, which also spares the P @ V product a
    transposition (8-bit tiles have no transposing shared-memory load: from the usual layout
    they are read a byte at a time). The V rows from ``end`` to the end of its block are read
    and zeroed; with WINDOWED, so are the V rows and V scales of keys before every row's first
    (hidden keys may then hold anything: NaN keys and key scales only reach their hidden
    scores); the keys and key scales are read as without it.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    v_first = start  # V rows (and V scales) before it are zeroed (V_PAGES)
    if V_PAGES and WINDOWED:
        v_first = tl.min(row_first, 0)
    for n in range(start, end, BLOCK_N):
        pos = n + offs_n
        if MASKED:
            in_range = pos < end
            block = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_table, mask=in_range, other=0)
            tile_mask = in_range[:, None] & mask_d[None, :]
        else:
            block = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_table)
            tile_mask = mask_d[None, :]
        block = block.to(tl.int64)
        offset = pos % BLOCK_SIZE
        k = tl.load(k_head_ptr + (block * stride_kb + offset * stride_ko)[:, None]
                    + (offs_d * stride_kd)[None, :], mask=tile_mask, other=0.0)
        if QUANT:
            if MASKED:
                k_scale = tl.load(k_scale_head_ptr + block * stride_ksb + offset * stride_kso,
                                  mask=in_range, other=0.0)
            else:
                k_scale = tl.load(k_scale_head_ptr + block * stride_ksb + offset * stride_kso)
            if INT8_FP16:
                kw = int8_to_fp16(k)
            else:
                kw = k.to(q.dtype)
            s = tl.dot(q, tl.trans(kw), input_precision=PRECISION)
            s = s * (k_scale * scale_log2)[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if MASKED:
            visible = pos[None, :] <= row_last[:, None]
            if WINDOWED:
                visible = visible & (pos[None, :] >= row_first[:, None]) & in_range[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOWED:
            # A row with no visible key so far keeps m = -inf; subtract 0 instead, so its alpha
            # and p are exp2(-inf) = 0 rather than NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_PAGES:
            v = load_value_pages(v_head_ptr, table_ptr, stride_table, stride_vb, stride_vo,
                                 stride_vd, n, v_first, end, BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM,
                                 MASKED)
        else:
            v = tl.load(v_head_ptr + (block * stride_vb + offset * stride_vo)[:, None]
                        + (offs_d * stride_vd)[None, :], mask=tile_mask, other=0.0)
        if QUANT:
            if MASKED:
                v_used = in_range
                if V_PAGES and WINDOWED:
                    v_used = v_used & (pos >= v_first)
                v_scale = tl.load(v_scale_head_ptr + block * stride_vsb + offset * stride_vso,
                                  mask=v_used, other=0.0)
            else:
                v_scale = tl.load(v_scale_head_ptr + block * stride_vsb + offset * stride_vso)
            if INT8_FP16:
                vw = int8_to_fp16(v)
            else:
                vw = v.to(q.dtype)
            acc = tl.dot((p * (v_scale * V_FOLD)[None, :]).to(q.dtype), vw, acc * alpha[:, None],
                         input_precision=PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i
