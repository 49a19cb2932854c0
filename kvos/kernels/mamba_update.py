"""One decode step of a Mamba2 layer's SSM over paged states, fused: each state tile is read once
from its request's block and written once to the block its new state goes to.

``h' = h * exp(dt A) * keep + dt x B^T``, ``y = h' C + D x`` per (sequence, head), float32, as
``Mamba2Mixer._decode``'s torch form computes it. Rows whose ``valid`` is 0 (CUDA-graph padding)
write nothing. Reading and writing the same block (a request inside a block) is safe: every
program reads its tile before writing it and no two programs share a tile. No host
synchronisation: safe inside a CUDA graph capture once compiled by a warm-up call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_P = 8


@triton.jit
def _ssm_decode_kernel(
    ssm_ptr, reads_ptr, writes_ptr, keep_ptr, valid_ptr,
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr,
    s_blk, s_head, s_p,
    sx_n, sx_h, sdt_n, sb_n, sb_h, sc_n, sc_h, sy_n, sy_h,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    k = tl.arange(0, N)
    pmask = p < P
    read = tl.load(reads_ptr + i).to(tl.int64)
    write = tl.load(writes_ptr + i).to(tl.int64)
    keep = tl.load(keep_ptr + i)
    valid = tl.load(valid_ptr + i)
    dt = tl.load(dt_ptr + i * sdt_n + h)
    a = tl.load(a_ptr + h)
    x = tl.load(x_ptr + i * sx_n + h * sx_h + p, mask=pmask, other=0.0)
    b = tl.load(b_ptr + i * sb_n + h * sb_h + k)
    c = tl.load(c_ptr + i * sc_n + h * sc_h + k)
    tile = p[:, None] * s_p + k[None, :]
    state = tl.load(ssm_ptr + read * s_blk + h * s_head + tile, mask=pmask[:, None], other=0.0)
    state = state * (tl.exp(dt * a) * keep) + (dt * x)[:, None] * b[None, :]
    y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + h) * x
    tl.store(y_ptr + i * sy_n + h * sy_h + p, y, mask=pmask)
    tl.store(ssm_ptr + write * s_blk + h * s_head + tile, state, mask=pmask[:, None] & (valid != 0))


def ssm_decode(ssm: torch.Tensor, reads: torch.Tensor, writes: torch.Tensor, keep: torch.Tensor,
               valid: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """ssm ``[blocks, H, P, N]`` float32 (any block stride; unit stride on N, contiguous per
    head); reads/writes ``[n]`` block ids; keep ``[n]`` float (0: start from zeros); valid
    ``[n]`` (None: all); x ``[n, H, P]``, dt ``[n, H]``, B/C ``[n, H, N]`` (views of expanded
    groups are fine), A/D ``[H]``, all float32. Returns y ``[n, H, P]`` without the gate."""
    n, H, P = x.shape
    N = ssm.shape[-1]
    assert ssm.stride(3) == 1 and ssm.stride(2) == N and x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1
    assert N & (N - 1) == 0, "state_size must be a power of two"
    y = torch.empty(n, H, P, dtype=torch.float32, device=x.device)
    if valid is None:
        valid = torch.ones(n, dtype=torch.int32, device=x.device)
    grid = (n, H, triton.cdiv(P, _BLOCK_P))
    _ssm_decode_kernel[grid](
        ssm, reads, writes, keep.reshape(n).contiguous(), valid.to(torch.int32),
        x, dt, A, B, C, D, y,
        ssm.stride(0), ssm.stride(1), ssm.stride(2),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        y.stride(0), y.stride(1),
        P=P, N=N, BLOCK_P=_BLOCK_P, num_warps=4)
    return y
