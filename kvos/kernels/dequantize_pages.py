"""A sequence's 8-bit paged K/V dequantized into a dense scratch cache, so that long prefill
chunks run the 16-bit attention kernel instead of converting every tile in their inner loop."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvos.kernels.kv_quant import kv_dtype_of


@triton.jit(do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "k_scale_ptr",
                                            "v_scale_ptr"])
def _dequantize_pages_kernel(
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
    k_out_ptr, v_out_ptr,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    stride_tb, stride_tn,
    stride_ob, stride_oo, stride_oh, stride_od,
    max_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Program (block b of sequence s, kv head h): rows ``b * BLOCK_SIZE ..`` of the sequence
    into scratch block ``s * max_blocks + b``. Rows at or past the sequence's length are not read
    and are written as 0; blocks wholly past it are neither read nor written."""
    b = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if b * BLOCK_SIZE >= seq_len:
        return
    src = tl.load(block_tables_ptr + seq * stride_tb + b * stride_tn).to(tl.int64)
    dst = (seq * max_blocks + b).to(tl.int64)
    offs_o = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    used = b * BLOCK_SIZE + offs_o < seq_len
    mask = used[:, None] & (offs_d < HEAD_DIM)[None, :]
    out = dst * stride_ob + h * stride_oh + offs_o[:, None] * stride_oo + offs_d[None, :] * stride_od
    k = tl.load(k_cache_ptr + src * stride_kb + h * stride_kh + offs_o[:, None] * stride_ko
                + offs_d[None, :] * stride_kd, mask=mask, other=0.0)
    ks = tl.load(k_scale_ptr + src * stride_ksb + h * stride_ksh + offs_o * stride_kso, mask=used,
                 other=0.0)
    tl.store(k_out_ptr + out, (k.to(tl.float32) * ks[:, None]).to(k_out_ptr.dtype.element_ty),
             mask=offs_d[None, :] < HEAD_DIM)
    v = tl.load(v_cache_ptr + src * stride_vb + h * stride_vh + offs_o[:, None] * stride_vo
                + offs_d[None, :] * stride_vd, mask=mask, other=0.0)
    vs = tl.load(v_scale_ptr + src * stride_vsb + h * stride_vsh + offs_o * stride_vso, mask=used,
                 other=0.0)
    tl.store(v_out_ptr + out, (v.to(tl.float32) * vs[:, None]).to(v_out_ptr.dtype.element_ty),
             mask=offs_d[None, :] < HEAD_DIM)


def dequantized_pages_bytes(num_seqs: int, max_seq_len: int, k_cache: torch.Tensor,
                            dtype: torch.dtype) -> int:
    """Bytes of the scratch ``dequantize_pages`` allocates for these sizes (K and V)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_blocks = -(-max_seq_len // block_size)
    return 2 * num_seqs * max_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize


def dequantize_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                     v_scale: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     max_seq_len: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``seq_lens[s]`` rows of each sequence's K and V, dequantized
    (``kv_quant.dequantize``: ``x * scale`` in float32, then cast to ``dtype``), as a dense paged
    cache: ``(k, v, tables)``, k and v ``[S * max_blocks, block_size, KVH, D]`` in ``dtype``
    (``max_blocks = ceil(max_seq_len / block_size)``), ``tables`` ``[S, max_blocks]`` int32
    with sequence s in blocks ``s * max_blocks ..``: attention over them with ``tables`` equals
    attention over the quantized cache dequantized.

    Caches and scales as ``paged_prefill_attention`` takes them (8-bit, any strides, V
    token-minor or not); ``seq_lens`` ``[S]`` int on the device; ``max_seq_len`` a host-side
    bound on every ``seq_lens[s]`` (it sizes the scratch, ``dequantized_pages_bytes``; a row
    past it is never read). Only table entries below ``ceil(seq_lens[s] / block_size)`` are read
    (the others may be anything), and only rows below ``seq_lens[s]`` of those blocks; the
    scratch rows from ``seq_lens[s]`` to the end of the sequence's blocks hold 0 or are never
    written, so a reader must stop at ``seq_lens[s]``. No host synchronisation.
    """
    assert kv_dtype_of(k_cache.dtype) is not None and v_cache.dtype == k_cache.dtype
    assert v_cache.shape == k_cache.shape and k_scale.shape == v_scale.shape == k_cache.shape[:3]
    num_seqs = seq_lens.shape[0]
    assert block_tables.shape[0] == num_seqs
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_blocks = max(1, -(-max_seq_len // block_size))
    shape = (num_seqs * max_blocks, block_size, num_kv_heads, head_dim)
    k = torch.empty(shape, dtype=dtype, device=k_cache.device)
    v = torch.empty(shape, dtype=dtype, device=k_cache.device)
    tables = torch.arange(num_seqs * max_blocks, dtype=torch.int32,
                          device=k_cache.device).view(num_seqs, max_blocks)
    if num_seqs and max_seq_len > 0:
        _dequantize_pages_kernel[(max_blocks, num_seqs, num_kv_heads)](
            k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, k, v,
            *k_cache.stride(), *v_cache.stride(), *k_scale.stride(), *v_scale.stride(),
            *block_tables.stride(), *k.stride(), max_blocks,
            BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(head_dim), HEAD_DIM=head_dim,
        )
    return k, v, tables
