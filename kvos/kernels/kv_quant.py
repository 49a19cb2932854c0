"""Quantized KV: the format, in torch (the CPU path and the reference the Triton kernels match).

A row is one token's K (or V) in one kv head: ``head_dim`` values quantized with one float32
scale, symmetric, ``x ~= q * scale``. The scale is per (token, layer, K or V, kv head) because a
paged cache is written one token at a time: a scale shared by a block would have to be raised, and
the block's earlier tokens re-quantized, whenever a later token is larger, so a block's bytes would
depend on how its tokens were chunked and a prefix-cached block could change under a reader. A
token's row is written once and never again.

int8: ``scale = amax(|row|) / 127``. fp8 e4m3: the scale is searched at write time among
``FP8_SCALE_CANDIDATES`` (16) candidates ``(amax(|row|) / 448) * m``, ``m = 1 + j/16`` (j = 0..15,
so m <= 31/16), keeping the one whose dequantized row has the least squared error against the row
(summed in float64; ties: the smallest m). A larger scale moves the row's values onto other points
of e4m3's uneven grid and can round the bulk of the row better at the cost of the largest
values' precision; the stored format (values, one float32 scale per row) and every reader are
unchanged. A row of zeros gets scale 0 and quantizes to zeros.

Error of one value (round to nearest), with ``scale`` the row's stored scale: int8
``|x - x'| <= scale / 2``; fp8 e4m3 (3 mantissa bits) ``|x - x'| <= max(|x| * 2**-4, scale *
2**-10)`` (the second term covers subnormals), for any of the candidate scales since
``|x / scale| <= 448``; with ``scale <= 31/16 * amax / 448`` that is at most ``max(|x| * 2**-4,
amax * 31/16 / 448 * 2**-10)``. (Up to float32 rounding of the scale, the division and the
product.) The row's squared error is at most that of the plain ``amax / 448`` scale.
"""
from __future__ import annotations

import torch

QMAX = {"fp8_e4m3": 448.0, "int8": 127.0}
"""The largest magnitude each format holds (e4m3fn's largest finite value; int8 kept symmetric)."""

TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}

MIN_SCALE = 1e-30
"""Divisor floor: a row of zeros gets scale 0 and quantizes to zeros."""

FP8_SCALE_CANDIDATES = 16
"""fp8 e4m3 scale candidates per row: ``(amax / 448) * (1 + j / 16)``, j < 16 (see the module doc)."""


def kv_dtype_of(storage: torch.dtype) -> str | None:
    """The quantized KV dtype name of a cache tensor's dtype (None: not quantized)."""
    return next((name for name, t in TORCH_DTYPES.items() if t == storage), None)


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x[..., D]`` -> (values ``[..., D]`` of ``TORCH_DTYPES[kv_dtype]``, float32 scales ``[...]``).

    int8: ``scale = amax / 127``. fp8_e4m3: the least-squared-error scale among
    ``FP8_SCALE_CANDIDATES`` candidates ``(amax / 448) * (1 + j / 16)`` (all float32 operations,
    the error summed in float64, ties to the smallest j), as the Triton write kernel does."""
    qmax = QMAX[kv_dtype]
    xf = x.float()
    base = xf.abs().amax(-1) / qmax
    if kv_dtype == "int8":
        y = (xf / base.clamp_min(MIN_SCALE).unsqueeze(-1)).clamp(-qmax, qmax).round()
        return y.to(torch.int8), base
    n = FP8_SCALE_CANDIDATES
    m = 1.0 + torch.arange(n, dtype=torch.float32, device=xf.device) / n  # exact in float32
    scales = base.unsqueeze(-1) * m  # [..., n]
    s = scales.clamp_min(MIN_SCALE).unsqueeze(-1)  # [..., n, 1]
    q = (xf.unsqueeze(-2) / s).clamp(-qmax, qmax).to(torch.float8_e4m3fn)  # [..., n, D]
    err = (q.double() * scales.double().unsqueeze(-1) - xf.double().unsqueeze(-2)).square().sum(-1)
    best = err.argmin(-1, keepdim=True)  # the first minimum: ties go to the smallest m
    values = q.view(torch.uint8).gather(-2, best.unsqueeze(-1).expand(*q.shape[:-2], 1, q.shape[-1]))
    return values.squeeze(-2).view(torch.float8_e4m3fn), scales.gather(-1, best).squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q[..., D] * scale[..., None]`` in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
