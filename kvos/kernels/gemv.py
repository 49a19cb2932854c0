"""Weight products of one-row decode steps: ``out = act(x) @ W^T (+ bias)`` for ``x [1, K]`` (or
``[1, 2K]`` = ``[gate | up]`` with a gated activation), ``W [N, K]``, in one Triton kernel that
streams ``W`` once.

At one row the product is a read of the weight matrix. On an H200 (copy ceiling 4.2 TB/s),
Llama-3.1-8B's shapes with each weight out of L2 (``benchmarks/scripts/gemv_rows.py``): cuBLAS
reaches 2.5 / 3.1 / 3.4 / 3.6 / 3.7 TB/s on o / qkv / gate_up / down / lm_head and adds a split-K
reduction kernel to two of them; this kernel 3.2 / 3.6 / 4.2 / 3.8 / 4.4 TB/s. With 2-16 rows a
``tl.dot`` version was no faster than cuBLAS, so those stay on cuBLAS.

Each program owns ``BLOCK_N`` output columns and sweeps all of K in float32 FMAs (no reduction
pass, no atomics): the result does not depend on the launch; it rounds once to the output
dtype, as cuBLAS does (the order of the sums differs, so results may differ from cuBLAS's in
the last bit). With ``activation`` the input is ``[gate | up]`` and each element of
``act(gate) * up`` is computed as it is read, with the same roundings as the elementwise
kernels' output (``kvos.kernels.elementwise``), so the fused product equals the product of
their output exactly. Safe inside a CUDA graph capture once each shape has been compiled (no
host synchronisation; the output is allocated with ``torch.empty``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvos.kernels import pdl
from kvos.kernels.elementwise import (
    LIBDEVICE_EXP,
    gelu_tanh_mul_rounded,
    silu_mul_rounded,
)
from kvos.kernels.pdl import wait_for_previous


class GemvTiles(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int


def tiles_for(n: int, k: int) -> GemvTiles:
    """The launch shape for ``W [n, k]``: the best of seven on each Llama-3.1-8B weight on the
    H200 (``benchmarks/scripts/gemv_rows.py``): 16 x 256 for the wide
    matrices (gate_up, the output layer), 16 x 512 with 8 warps for the long rows (down), else
    8 x 512 with 4 warps (qkv, o)."""
    if n >= 16384:
        return GemvTiles(16, 256, 4, 3)
    if k >= 8192:
        return GemvTiles(16, 512, 8, 3)
    return GemvTiles(8, 512, 4, 3)


ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2}


@triton.jit
def _weight_tile(w_rows, kk, n_mask, k_mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_rows + kk[None, :], mask=n_mask[:, None], eviction_policy="evict_first")
    return tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _input_tile(x_ptr, kk, k_mask, K: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Elements ``kk`` of the product's input in float32 (``act(gate) * up`` rounded as stored for
    ACT 1 / 2)."""
    x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    if ACT == 1:
        x = silu_mul_rounded(x, tl.load(x_ptr + K + kk, mask=k_mask, other=0.0).to(tl.float32),
                             x_ptr.dtype.element_ty, LIBDEVICE)
    elif ACT == 2:
        x = gelu_tanh_mul_rounded(x, tl.load(x_ptr + K + kk, mask=k_mask, other=0.0).to(tl.float32),
                                  x_ptr.dtype.element_ty, LIBDEVICE)
    return x


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, sw, K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    """Columns ``pid * BLOCK_N ..`` of the one output row. K is a compile-time constant (a model
    has few), so the loop's trip count is known. ACT 1 / 2: x is ``[gate | up]`` (2K wide) and
    the product reads ``silu(gate) * up`` / ``gelu_tanh(gate) * up`` rounded as stored.

    The first weight tile is loaded before ``wait_for_previous``: under a dependent launch it
    streams while the kernel before finishes. Safe because weights are never written while
    steps run (the exception to ``kvos.kernels.pdl``'s rule); x and everything else come after."""
    cols_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols_n[:, None] * sw
    w = _weight_tile(w_rows, ks, n_mask, ks < K, EVEN_K)
    wait_for_previous(PDL)
    acc = w.to(tl.float32) * _input_tile(x_ptr, ks, ks < K, K, ACT, LIBDEVICE)[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        kk = k + ks
        k_mask = kk < K
        w = _weight_tile(w_rows, kk, n_mask, k_mask, EVEN_K)
        acc += w.to(tl.float32) * _input_tile(x_ptr, kk, k_mask, K, ACT, LIBDEVICE)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def applies(x: torch.Tensor, weight: torch.Tensor, activation: str | None = None) -> bool:
    """Whether ``matmul`` takes this product: one row of a 16-bit float dtype, the weight in the
    same dtype, unit strides on K, and x ``K`` wide (``2K`` with an activation)."""
    width = weight.shape[-1] * (1 if activation is None else 2)
    return (x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == width and weight.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1 and activation in ACTIVATIONS)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, tiles: GemvTiles | None = None) -> torch.Tensor:
    """``act(x) @ weight^T (+ bias)`` as ``[1, N]`` in x's dtype; only where ``applies``.
    ``tiles``: another launch shape than ``tiles_for``'s (benchmarks)."""
    n, k = weight.shape
    tiles = tiles or tiles_for(n, k)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, bias if bias is not None else weight, out, n, weight.stride(0), K=k,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=k % tiles.block_k == 0, HAS_BIAS=bias is not None,
        ACT=ACTIVATIONS[activation], LIBDEVICE=LIBDEVICE_EXP, num_warps=tiles.warps, num_stages=tiles.stages,
        **pdl.launch_args(x))
    return out
