"""Quantized KV: the format, in torch (the CPU path and the reference the Triton kernels match).

A row is one token's K (or V) in one kv head: ``head_dim`` values quantized with one float32
scale, symmetric, ``x ~= q * scale`` with ``scale = amax(|row|) / QMAX``. The scale is per
(token, layer, K or V, kv head) because a paged cache is written one token at a time: a scale
shared by a block would have to be raised, and the block's earlier tokens re-quantized, whenever
a later token is larger, so a block's bytes would depend on how its tokens were chunked and a
prefix-cached block could change under a reader. A token's row is written once and never again.

Error of one value (round to nearest): int8 ``|x - x'| <= scale / 2``; fp8 e4m3 (3 mantissa
bits) ``|x - x'| <= max(|x| * 2**-4, scale * 2**-10)`` (the second term covers subnormals).
"""
from __future__ import annotations

import torch

QMAX = {"fp8_e4m3": 448.0, "int8": 127.0}
"""The largest magnitude each format holds (e4m3fn's largest finite value; int8 kept symmetric)."""

TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}

MIN_SCALE = 1e-30
"""Divisor floor: a row of zeros gets scale 0 and quantizes to zeros."""


def kv_dtype_of(storage: torch.dtype) -> str | None:
    """The quantized KV dtype name of a cache tensor's dtype (None: not quantized)."""
    return next((name for name, t in TORCH_DTYPES.items() if t == storage), None)


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x[..., D]`` -> (values ``[..., D]`` of ``TORCH_DTYPES[kv_dtype]``, float32 scales ``[...]``)."""
    qmax = QMAX[kv_dtype]
    xf = x.float()
    scale = xf.abs().amax(-1) / qmax
    y = (xf / scale.clamp_min(MIN_SCALE).unsqueeze(-1)).clamp(-qmax, qmax)
    if kv_dtype == "int8":
        y = y.round()
    return y.to(TORCH_DTYPES[kv_dtype]), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q[..., D] * scale[..., None]`` in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
