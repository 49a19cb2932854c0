"""One decode step of a Mamba2 layer over paged states in two fused kernels, and the layer's
gated RMS norm (decode and prefill rows).

- ``conv_decode``: the causal convolution's one new output per channel (then SiLU) from the
  state block's last ``conv_width`` inputs and the new input; the shifted window written to the
  block the new state goes to.
- ``ssm_decode``: ``dt = clamp(softplus(dt_raw + dt_bias))``, ``A = -exp(A_log)``, ``h' = h *
  exp(dt A) * keep + dt x B^T``, ``y = h' C + D x`` per (sequence, head), float32, as
  ``Mamba2Mixer._decode``'s torch form computes it; heads read their group's B and C.
- ``gated_rms_norm``: ``weight * rmsnorm_per_group(y * silu(z))`` in float32, rounded once to the
  output's dtype.

Rows whose ``valid`` is 0 (CUDA-graph padding) write no state. Reading and writing the same block
(a request inside a block) is safe: every program reads its tile of the state before writing it
and no two programs share a tile. No host synchronisation: safe inside a CUDA graph capture once
compiled by a warm-up call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_P = 8
_CONV_BLOCK = 256


@triton.jit
def _conv_decode_kernel(
    conv_ptr, reads_ptr, writes_ptr, keep_ptr, valid_ptr, x_ptr, w_ptr, bias_ptr, out_ptr,
    s_blk, s_ch, sx_n, sw_c, so_n, conv_dim,
    W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    i = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = ch < conv_dim
    k = tl.arange(0, WP)
    read = tl.load(reads_ptr + i).to(tl.int64)
    write = tl.load(writes_ptr + i).to(tl.int64)
    keep = tl.load(keep_ptr + i)
    valid = tl.load(valid_ptr + i)
    x = tl.load(x_ptr + i * sx_n + ch, mask=cm, other=0.0).to(tl.float32)
    tap = ch[:, None] * sw_c + k[None, :]
    old_at = conv_ptr + read * s_blk + ch[:, None] * s_ch
    old = tl.load(old_at + k[None, :], mask=cm[:, None] & (k < W)[None, :], other=0.0) * keep
    shifted = tl.load(old_at + k[None, :] + 1, mask=cm[:, None] & (k + 1 < W)[None, :], other=0.0) * keep
    acc = tl.sum(old * tl.load(w_ptr + tap, mask=cm[:, None] & (k < W)[None, :], other=0.0).to(tl.float32), axis=1)
    acc += x * tl.load(w_ptr + ch * sw_c + W, mask=cm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + i * so_n + ch, acc * tl.sigmoid(acc), mask=cm)
    window = tl.where((k == W - 1)[None, :], x[:, None], shifted)
    tl.store(conv_ptr + write * s_blk + ch[:, None] * s_ch + k[None, :], window,
             mask=cm[:, None] & (k < W)[None, :] & (valid != 0))


def conv_decode(conv: torch.Tensor, reads: torch.Tensor, writes: torch.Tensor, keep: torch.Tensor,
                valid: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """conv ``[blocks, conv_dim, W]`` float32 (unit stride on W); reads/writes ``[n]`` block ids;
    keep ``[n]`` float (0: the window starts from zeros); valid ``[n]`` (None: all); x ``[n,
    conv_dim]`` the new inputs (any float dtype, unit stride on channels); weight ``[conv_dim, 1,
    W + 1]`` (conv1d's), bias ``[conv_dim]`` or None. Returns SiLU of the convolution ``[n,
    conv_dim]`` float32."""
    n, conv_dim = x.shape
    W = conv.shape[2]
    assert conv.stride(2) == 1 and x.stride(1) == 1 and weight.stride(2) == 1
    out = torch.empty(n, conv_dim, dtype=torch.float32, device=x.device)
    if valid is None:
        valid = torch.ones(n, dtype=torch.int32, device=x.device)
    _conv_decode_kernel[(n, triton.cdiv(conv_dim, _CONV_BLOCK))](
        conv, reads, writes, keep.reshape(n), valid.to(torch.int32), x, weight,
        bias if bias is not None else weight, out,
        conv.stride(0), conv.stride(1), x.stride(0), weight.stride(0), out.stride(0), conv_dim,
        W=W, WP=triton.next_power_of_2(W), BLOCK=_CONV_BLOCK, HAS_BIAS=bias is not None, num_warps=4)
    return out


@triton.jit
def softplus(x):
    """torch's softplus (threshold 20): ``log1p(exp(x))``, x itself above 20 (log1p's series
    where ``1 + e`` would round to 1)."""
    e = tl.exp(tl.minimum(x, 20.0))
    return tl.where(x > 20.0, x, tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e)))


@triton.jit
def _ssm_decode_kernel(
    ssm_ptr, reads_ptr, writes_ptr, keep_ptr, valid_ptr,
    x_ptr, dt_ptr, dt_bias_ptr, a_log_ptr, b_ptr, c_ptr, d_ptr, y_ptr,
    s_blk, s_head, s_p,
    sx_n, sx_h, sdt_n, sb_n, sb_g, sc_n, sc_g, sy_n, sy_h, heads_per_group, dt_min, dt_max,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    g = h // heads_per_group
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    k = tl.arange(0, N)
    pmask = p < P
    read = tl.load(reads_ptr + i).to(tl.int64)
    write = tl.load(writes_ptr + i).to(tl.int64)
    keep = tl.load(keep_ptr + i)
    valid = tl.load(valid_ptr + i)
    dt = tl.load(dt_ptr + i * sdt_n + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = tl.minimum(tl.maximum(softplus(dt), dt_min), dt_max)
    a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + i * sx_n + h * sx_h + p, mask=pmask, other=0.0)
    b = tl.load(b_ptr + i * sb_n + g * sb_g + k)
    c = tl.load(c_ptr + i * sc_n + g * sc_g + k)
    tile = p[:, None] * s_p + k[None, :]
    state = tl.load(ssm_ptr + read * s_blk + h * s_head + tile, mask=pmask[:, None], other=0.0)
    state = state * (tl.exp(dt * a) * keep) + (dt * x)[:, None] * b[None, :]
    y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + i * sy_n + h * sy_h + p, y, mask=pmask)
    tl.store(ssm_ptr + write * s_blk + h * s_head + tile, state, mask=pmask[:, None] & (valid != 0))


def ssm_decode(ssm: torch.Tensor, reads: torch.Tensor, writes: torch.Tensor, keep: torch.Tensor,
               valid: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor,
               A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
               dt_limits: tuple[float, float] = (0.0, float("inf")), y: torch.Tensor | None = None) -> torch.Tensor:
    """ssm ``[blocks, H, P, N]`` float32 (any block stride; unit stride on N, contiguous per
    head); reads/writes ``[n]`` block ids; keep ``[n]`` float (0: start from zeros); valid
    ``[n]`` (None: all); x ``[n, H, P]`` float32; dt ``[n, H]`` before its bias and softplus (any
    float dtype); dt_bias, A_log, D ``[H]``; B/C ``[n, G, N]`` float32 (head h reads group ``h //
    (H / G)``). Writes y ``[n, H, P]`` (float32; allocated when None) without the gate and returns it."""
    n, H, P = x.shape
    G, N = B.shape[1], ssm.shape[-1]
    assert ssm.stride(3) == 1 and ssm.stride(2) == N and x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1
    assert N & (N - 1) == 0, "state_size must be a power of two"
    if y is None:
        y = torch.empty(n, H, P, dtype=torch.float32, device=x.device)
    if valid is None:
        valid = torch.ones(n, dtype=torch.int32, device=x.device)
    grid = (n, H, triton.cdiv(P, _BLOCK_P))
    _ssm_decode_kernel[grid](
        ssm, reads, writes, keep.reshape(n), valid.to(torch.int32),
        x, dt, dt_bias, A_log, B, C, D, y,
        ssm.stride(0), ssm.stride(1), ssm.stride(2),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        y.stride(0), y.stride(1), H // G, float(dt_limits[0]), float(dt_limits[1]),
        P=P, N=N, BLOCK_P=_BLOCK_P, num_warps=4)
    return y


@triton.jit(do_not_specialize=["eps"])
def _gated_rms_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, sy, sz, so, eps,
                           GS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * GS + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < GS
    y = tl.load(y_ptr + t * sy + c, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * sz + c, mask=m, other=0.0).to(tl.float32)
    v = y * (z * tl.sigmoid(z))
    r = tl.math.rsqrt(tl.sum(v * v, axis=0) / GS + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * so + c, (w * (v * r)).to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """``weight * rmsnorm_per_group(y * silu(z))``: y ``[T, I]`` float32, z ``[T, I]`` (any float
    dtype; unit stride on I), weight ``[I]``; the RMS over each of ``groups`` equal slices of a
    row. Returns ``[T, I]`` in ``dtype``."""
    T, I = y.shape
    assert y.stride(1) == 1 and z.stride(1) == 1 and I % groups == 0
    out = torch.empty(T, I, dtype=dtype, device=y.device)
    gs = I // groups
    block = triton.next_power_of_2(gs)
    _gated_rms_norm_kernel[(T, groups)](y, z, weight, out, y.stride(0), z.stride(0), out.stride(0), eps,
                                        GS=gs, BLOCK=block, num_warps=min(16, max(4, block // 512)))
    return out
