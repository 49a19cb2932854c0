"""Scatter new K/V rows into the paged cache, quantizing them for a quantized cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvos.model.kv_quant import MIN_SCALE, QMAX, kv_dtype_of


@triton.jit
def _quantize_row(x, scale_ptr, mask_row, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                  ROUND: tl.constexpr):
    """Store the row's scale ``amax(|x|) / QMAX`` at ``scale_ptr`` (where ``mask_row``) and
    return ``clamp(x / max(scale, MIN_SCALE), -QMAX, QMAX)`` in fp32, rounded half to even when
    ROUND (int8), as ``kvos.model.kv_quant.quantize`` does. x: the row in fp32, zero where
    masked. Both divisions are correctly rounded (``div_rn``: Triton's ``/`` is approximate on
    CUDA), as torch's are on CPU, so scales and values match ``quantize`` there bit for bit."""
    scale = tl.div_rn(tl.max(tl.abs(x), 0), QMAX)
    tl.store(scale_ptr, scale, mask=mask_row)
    y = tl.div_rn(x, tl.maximum(scale, MIN_SCALE))
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if ROUND:
        # Round half to even (torch.round), exactly: |y| <= 127, so floor and y - floor are exact.
        r = tl.floor(y)
        frac = y - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        y = r + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)
    return y


@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "k_scale_ptr", "v_scale_ptr"])
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
    QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND: tl.constexpr,
):
    """One program copies one token's K and V row of one kv head. QUANT: quantizes each row
    (``_quantize_row``) and stores its scale too; otherwise the scale arguments are never read."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < head_dim) & (slot >= 0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + h * stride_kch + offs_d * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + offs_d * stride_vcd
    if QUANT:
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d * stride_kd, mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d * stride_vd, mask=mask, other=0.0)
        k = _quantize_row(k.to(tl.float32),
                          k_scale_ptr + block * stride_ksb + offset * stride_kso + h * stride_ksh,
                          slot >= 0, QMAX, MIN_SCALE, ROUND)
        v = _quantize_row(v.to(tl.float32),
                          v_scale_ptr + block * stride_vsb + offset * stride_vso + h * stride_vsh,
                          slot >= 0, QMAX, MIN_SCALE, ROUND)
    else:
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d * stride_kd, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d * stride_vd, mask=mask)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write token t's K/V into flat cache slot ``slot_mapping[t]``, cast to the cache dtype
    (quantized, with its scales, for a quantized cache: see k_scale).

    k, v: ``[T, KVH, D]``, any strides. k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``,
    any strides (each is addressed through its own). slot_mapping: ``[T]`` int32 or int64, slot =
    ``block_id * block_size + offset``; a negative slot skips its row (padding rows of a CUDA
    graph). Slots must be distinct (two rows writing one slot race). No host synchronisation, so
    it is safe inside a CUDA graph capture.

    k_scale, v_scale: a quantized cache (``kvos.model.kv_quant``), both or neither: float32
    ``[num_blocks, block_size, KVH]``, any strides, and k_cache, v_cache both float8_e4m3fn or
    both int8. Each (token, kv head) row of K and of V is then quantized as
    ``kv_quant.quantize`` does (symmetric, one scale per row: ``scale = amax(|row|) / QMAX``,
    values ``clamp(row / max(scale, MIN_SCALE), -QMAX, QMAX)``, int8 rounded half to even, fp8
    rounded to nearest) and its scale stored at the row's ``[block, offset, head]``. A skipped
    row writes no scale either. Without scales the kernel compiles as before (a QUANT=False
    constexpr).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert (k_scale is None) == (v_scale is None), "pass both k_scale and v_scale, or neither"
    if k_scale is None:
        kv_dtype = None
        scale_args = (k_cache, k_cache) + (0,) * 6  # never read
    else:
        kv_dtype = kv_dtype_of(k_cache.dtype)
        assert kv_dtype is not None and v_cache.dtype == k_cache.dtype, \
            "scaled caches must both be float8_e4m3fn or both int8"
        for s in (k_scale, v_scale):
            assert s.dtype == torch.float32 and s.shape == k_cache.shape[:3], \
                "scales: float32 [blocks, block_size, KVH]"
        scale_args = (k_scale, v_scale, *k_scale.stride(), *v_scale.stride())
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, *scale_args[:2],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *scale_args[2:],
        head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=kv_dtype is not None, QMAX=QMAX[kv_dtype] if kv_dtype else 0.0,
        MIN_SCALE=MIN_SCALE, ROUND=kv_dtype == "int8",
    )
