"""Fused elementwise kernels of the decoder: RMSNorm (optionally adding the residual first),
rotary embedding, SiLU-and-multiply and GELU(tanh)-and-multiply (Gemma).

Each kernel reproduces the rounding order of the torch definitions in ``kvos.models.ops``:
float32 math, rounded to the tensor dtype wherever torch rounds (after each elementwise op on
bf16/fp16 tensors). The wrappers read only shapes, strides and dtypes, allocate with
``torch.empty`` and launch one kernel: no host synchronisation, so they are safe inside a CUDA
graph capture once each shape has been compiled by a warm-up call. Inputs need a unit stride on
the last dimension; other strides are free (views of a fused projection's output work as they
are).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvos.kernels import pdl
from kvos.kernels.pdl import wait_for_previous

# Elements one program handles in its main block (per row block for RMSNorm, per half-head block
# for rotary, per row for SiLU-and-mul).
_RMS_BLOCK = 1024
_ROPE_BLOCK = 1024
_GATED_BLOCK = 1024
# torch's float exp is CUDA's expf, which libdevice's exp is; tl.exp is a faster approximation.
# The interpreter has no libdevice, so it uses tl.exp (numpy's exp).
LIBDEVICE_EXP = not triton.knobs.runtime.interpret


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (float32) rounded to dtype and widened back; a no-op for float32."""
    return x.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr,
    n_rows, heads,
    sx_t, sx_h, sr_t, sr_h, so_t, so_h, sro_t, sro_h,
    eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr, PDL: tl.constexpr = False,
):
    """ROWS rows of N per program; row r is (t, h) = divmod(r, heads) in each tensor's strides.
    WEIGHT_FIRST (Gemma): the float32 weight multiplies before the one rounding to x's dtype."""
    wait_for_previous(PDL)
    dtype = x_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t = rows // heads
    h = rows % heads
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + (t * sx_t + h * sx_h)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + (t * sr_t + h * sr_h)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = _round(x + r.to(tl.float32), dtype)
        tl.store(res_out_ptr + (t * sro_t + h * sro_h)[:, None] + cols[None, :], x.to(dtype), mask=mask)
    # torch's CUDA mean multiplies the sum by 1/N, then eps is added (no FMA: fusion is off).
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * (1.0 / N) + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if WEIGHT_FIRST:
        out = (x * rstd[:, None] * w[None, :]).to(out_ptr.dtype.element_ty)
    else:
        y = _round(x * rstd[:, None], dtype)
        out = (w[None, :] * y).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (t * so_t + h * so_h)[:, None] + cols[None, :], out, mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, stride_t, stride_h) of a ``[T, N]`` or ``[T, H, N]`` tensor."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             *, out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             weight_first: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, rounded like ``ops.rms_norm``'s torch path (with
    ``weight_first``, like ``ops.gemma_rms_norm``'s: ``(normalised * weight)`` in float32, rounded
    once, in x's dtype).

    x: ``[T, N]`` or ``[T, H, N]`` (per-head norms: Qwen3's q/k norm on a view of the fused qkv
    output, no copy needed), any strides with a unit last stride. weight: ``[N]``. Returns
    ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` in
    ``promote_types(x.dtype, weight.dtype)``. With ``residual`` (same shape and dtype as x), first
    ``x = x + residual`` in x's dtype, and returns ``(out, x)``.

    ``out`` / ``residual_out`` receive the results when given (any strides, unit last stride); each
    may be the input it replaces (``out=x``, ``residual_out=residual``) since a program reads its
    rows before writing them, but must not otherwise overlap an input. Allocation and launch only:
    CUDA-graph safe.
    """
    N = x.shape[-1]
    assert x.dim() in (2, 3) and weight.shape == (N,) and x.stride(-1) == 1 and weight.stride(0) == 1
    if out is None:
        dtype = x.dtype if weight_first else torch.promote_types(x.dtype, weight.dtype)
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    assert out.shape == x.shape and out.stride(-1) == 1
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        assert residual_out.shape == x.shape and residual_out.dtype == x.dtype and residual_out.stride(-1) == 1
    n_rows, heads, sx_t, sx_h = _as_rows(x)
    res, res_out = (residual, residual_out) if residual is not None else (x, out)
    block_n = triton.next_power_of_2(N)
    rows = max(1, _RMS_BLOCK // block_n)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x, res, out, res_out, weight, n_rows, heads,
        sx_t, sx_h, *_as_rows(res)[2:], *_as_rows(out)[2:], *_as_rows(res_out)[2:],
        eps, N=N, BLOCK_N=block_n, ROWS=rows, HAS_RES=residual is not None, WEIGHT_FIRST=weight_first,
        num_warps=min(16, max(1, rows * block_n // 512)), enable_fp_fusion=False, **pdl.launch_args(x),
    )
    return out if residual is None else (out, residual_out)


@triton.jit
def _rotate_heads(ptr, t, h0, n_heads, s_t, s_h, c1, c2, s1, s2,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate heads h0 .. h0+BLOCK_H-1 (those < n_heads) of token t in place; the cos/sin halves
    are float32 ``[BLOCK_D]`` already rounded to the tensor dtype."""
    dtype = ptr.dtype.element_ty
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < n_heads)[:, None] & (d < HALF)[None, :]
    p = ptr + t * s_t + h[:, None] * s_h + d[None, :]
    x1 = tl.load(p, mask=mask).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product rounded as torch does.
    o1 = _round(x1 * c1[None, :], dtype) - _round(x2 * s1[None, :], dtype)
    o2 = _round(x2 * c2[None, :], dtype) + _round(x1 * s2[None, :], dtype)
    tl.store(p, o1.to(dtype), mask=mask)
    tl.store(p + HALF, o2.to(dtype), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    n_q_heads, n_k_heads, sq_t, sq_h, sk_t, sk_h, s_cs,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (t, b): head block b of token t, q's blocks first, then k's."""
    wait_for_previous(PDL)
    dtype = q_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    row = pos * s_cs + d
    c1 = _round(tl.load(cos_ptr + row, mask=dm), dtype)
    c2 = _round(tl.load(cos_ptr + row + HALF, mask=dm), dtype)
    s1 = _round(tl.load(sin_ptr + row, mask=dm), dtype)
    s2 = _round(tl.load(sin_ptr + row + HALF, mask=dm), dtype)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if blk < q_blocks:
        _rotate_heads(q_ptr, t, blk * BLOCK_H, n_q_heads, sq_t, sq_h, c1, c2, s1, s2, HALF, BLOCK_H, BLOCK_D)
    else:
        _rotate_heads(k_ptr, t, (blk - q_blocks) * BLOCK_H, n_k_heads, sk_t, sk_h, c1, c2, s1, s2,
                      HALF, BLOCK_H, BLOCK_D)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-interleaved (HF ``rotate_half``) rotary embedding, IN PLACE: q and k are overwritten
    and returned.

    positions: ``[T]`` int32/int64. q: ``[T, H, D]``, k: ``[T, KVH, D]``, same dtype, any strides
    with a unit last stride (views of the fused qkv output work). cos, sin: float32
    ``[max_pos, D]`` with a unit last stride, as ``RotaryEmbedding`` builds them; positions must be
    below max_pos (not checked: that would synchronise). Computes
    ``x * c + rotate_half(x) * s`` with c, s = cos/sin[positions] rounded to x's dtype, each product
    and the sum rounded to x's dtype like torch; compiled without FMA contraction, so float32
    matches torch bit for bit. One launch for q and k; CUDA-graph safe.
    """
    T, n_q, D = q.shape
    n_k = k.shape[1]
    assert k.shape == (T, n_k, D) and k.dtype == q.dtype and positions.shape == (T,) and D % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1
    assert cos.shape == sin.shape and cos.shape[1] == D and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert cos.dtype == sin.dtype == torch.float32
    block_d = triton.next_power_of_2(D // 2)
    block_h = min(triton.next_power_of_2(max(n_q, n_k)), max(1, _ROPE_BLOCK // block_d))
    grid = (T, triton.cdiv(n_q, block_h) + triton.cdiv(n_k, block_h))
    _rope_kernel[grid](
        positions, q, k, cos, sin, n_q, n_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), HALF=D // 2, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4, enable_fp_fusion=False, **pdl.launch_args(q),
    )
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, sx_t, so_t, BLOCK: tl.constexpr,
                         LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, b): columns b*BLOCK .. of token t's ``[gate | up]`` row."""
    wait_for_previous(PDL)
    dtype = x_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + t * sx_t + cols, mask=mask).to(tl.float32)
    u = tl.load(x_ptr + t * sx_t + inter + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + t * so_t + cols, silu_mul_rounded(g, u, dtype, LIBDEVICE).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def silu_mul_rounded(g, u, dtype: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``silu(g) * u`` of float32 g and u, rounded to dtype as torch rounds it (the silu, then the
    product), widened back to float32. torch's silu: x / (1 + exp(-x)) in float32 with an IEEE
    division."""
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    s = _round(tl.math.div_rn(g, 1.0 + e), dtype)
    return _round(s * u, dtype)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of x = ``[gate | up]`` (``[T, 2*I]``, any row stride, unit last
    stride) into ``[T, I]`` (``out`` when given: same dtype, unit last stride, not overlapping x).
    The silu result is rounded to x's dtype before the product, like torch. CUDA-graph safe."""
    return _gated(_silu_and_mul_kernel, x, out)


def _gated(kernel, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Launch a gated-activation kernel over x = ``[gate | up]`` (see ``silu_and_mul``)."""
    T, two_i = x.shape
    inter = two_i // 2
    assert two_i % 2 == 0 and x.stride(1) == 1
    if out is None:
        out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    assert out.shape == (T, inter) and out.dtype == x.dtype and out.stride(1) == 1
    block = min(_GATED_BLOCK, triton.next_power_of_2(inter))
    kernel[(T, triton.cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                                          LIBDEVICE=LIBDEVICE_EXP, num_warps=4, **pdl.launch_args(x))
    return out


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, inter, sx_t, so_t, BLOCK: tl.constexpr,
                              LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, b): columns b*BLOCK .. of token t's ``[gate | up]`` row."""
    wait_for_previous(PDL)
    dtype = x_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + t * sx_t + cols, mask=mask).to(tl.float32)
    u = tl.load(x_ptr + t * sx_t + inter + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + t * so_t + cols, gelu_tanh_mul_rounded(g, u, dtype, LIBDEVICE).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def gelu_tanh_mul_rounded(g, u, dtype: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``gelu_tanh(g) * u`` of float32 g and u, rounded to dtype as torch rounds it, widened back
    to float32. torch's CUDA gelu(approximate="tanh") in float32: kBeta = float(sqrt(2) *
    2/sqrt(pi) * 0.5), inner = kBeta * (x + kKappa * x^3), 0.5 * x * (1 + tanh(inner)); tanhf is
    libdevice's tanh."""
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    if LIBDEVICE:
        th = libdevice.tanh(inner)
    else:  # the interpreter: tanh from exp (saturated to avoid overflow)
        th = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(tl.maximum(inner, -20.0), 20.0)) + 1.0)
    y = _round(0.5 * g * (1.0 + th), dtype)
    return _round(y * u, dtype)


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of x = ``[gate | up]`` (``[T, 2*I]``, any row
    stride, unit last stride) into ``[T, I]`` (``out`` when given: same dtype, unit last stride,
    not overlapping x). The GELU result is rounded to x's dtype before the product, like torch.
    CUDA-graph safe."""
    return _gated(_gelu_tanh_and_mul_kernel, x, out)
