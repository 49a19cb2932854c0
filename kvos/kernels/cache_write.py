"""Scatter new K/V rows into the paged cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program copies one token's K and V row of one kv head."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < head_dim) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + h * stride_kch + offs_d * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + offs_d * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write token t's K/V into flat cache slot ``slot_mapping[t]``, cast to the cache dtype.

    k, v: ``[T, KVH, D]``, any strides. k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``,
    any strides (each is addressed through its own). slot_mapping: ``[T]`` int32 or int64, slot =
    ``block_id * block_size + offset``; a negative slot skips its row (padding rows of a CUDA
    graph). Slots must be distinct (two rows writing one slot race). No host synchronisation, so
    it is safe inside a CUDA graph capture.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_D=triton.next_power_of_2(head_dim),
    )
