"""The inner loop shared by the paged attention kernels: online softmax over a range of keys
gathered through a block table, plus the host-side choices both wrappers make the same way (and,
under Triton's CPU interpreter only, a fix that lets it run these kernels)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
                       block_tables: torch.Tensor) -> int:
    """Validate shapes shared by the attention wrappers; return the GQA group size H // KVH."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches: [blocks, block_size, KVH, D]"
    assert k_cache.shape[3] == head_dim, "q and the caches disagree on head_dim"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_tables.dim() == 2 and not block_tables.is_floating_point()
    return num_heads // num_kv_heads


@triton.jit
def attend_key_range(
    acc, m_i, l_i, q, row_first, row_last, start, end,
    k_head_ptr, v_head_ptr, table_ptr, stride_table,
    stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
    scale_log2,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
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
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
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
        v = tl.load(v_head_ptr + (block * stride_vb + offset * stride_vo)[:, None]
                    + (offs_d * stride_vd)[None, :], mask=tile_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i
