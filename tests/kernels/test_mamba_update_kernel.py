"""The fused Mamba2 decode kernels and the gated norm against the mixer's torch forms: outputs
and the states they write within 1e-5 (float32, summation order), in-place and cross-block
updates, a sequence starting from zeros, padding rows that write nothing, heads sharing their
group's B and C, and the other layer's slot of each page untouched."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_interpreter import (  # first: before triton loads
    CUDA,
    skip_unless_interpreted,
)

pytest.importorskip("triton")

from kvos.kernels.mamba_update import (  # noqa: E402
    _conv_decode_kernel,
    _gated_rms_norm_kernel,
    _ssm_decode_kernel,
    conv_decode,
    gated_rms_norm,
    ssm_decode,
)

skip_unless_interpreted(_ssm_decode_kernel, _conv_decode_kernel, _gated_rms_norm_kernel)
pytestmark = pytest.mark.gpu
DEV = "cuda" if CUDA else "cpu"
READS = [2, 0, 4, 5]
WRITES = [2, 3, 6, 0]  # in place; from zeros; to the next block; padding
KEEP = [1.0, 0.0, 1.0, 1.0]
VALID = [True, True, True, False]


def _rows():
    return (torch.tensor(READS, device=DEV), torch.tensor(WRITES, device=DEV), torch.tensor(KEEP, device=DEV),
            torch.tensor(VALID, device=DEV))


def test_ssm_decode_matches_the_torch_form():
    g = torch.Generator().manual_seed(0)
    n, H, G, P, N, blocks = 4, 4, 2, 12, 16, 7
    pool = torch.randn(blocks, 2, H, P, N, generator=g).to(DEV)  # a page-major pool: 2 slots per block
    ssm = pool[:, 1]
    x, dt_raw = torch.randn(n, H, P, generator=g).to(DEV), (torch.randn(n, H, generator=g) * 3).to(DEV)
    dt_raw[0, 0], dt_raw[1, 1] = 25.0, -30.0  # softplus's linear branch; a step under dt_min
    dt_bias, A_log, D = (torch.randn(H, generator=g).to(DEV) for _ in range(3))
    B, C = torch.randn(n, G, N, generator=g).to(DEV), torch.randn(n, G, N, generator=g).to(DEV)
    reads, writes, keep, valid = _rows()
    before, other_slot = ssm.clone(), pool[:, 0].clone()
    dt = F.softplus(dt_raw + dt_bias).clamp(1e-3, 10.0)
    A = -torch.exp(A_log)
    Bh, Ch = B.repeat_interleave(H // G, 1), C.repeat_interleave(H // G, 1)
    h = before[reads] * (torch.exp(dt * A) * keep[:, None])[:, :, None, None] + (dt[:, :, None] * x)[..., None] * Bh[:, :, None, :]
    ref = torch.einsum("nhpk,nhk->nhp", h, Ch) + D[:, None] * x
    y = ssm_decode(ssm, reads, writes, keep, valid, x, dt_raw, dt_bias, A_log, B, C, D, (1e-3, 10.0))
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    for row in range(3):
        assert torch.allclose(ssm[writes[row]], h[row], atol=1e-5, rtol=1e-5)
    for untouched in (0, 1, 4, 5):
        assert torch.equal(ssm[untouched], before[untouched])
    assert torch.equal(pool[:, 0], other_slot)  # the other layer's slot of each page


def test_conv_decode_matches_the_torch_form():
    g = torch.Generator().manual_seed(1)
    n, conv_dim, W, blocks = 4, 300, 3, 7  # conv_dim over one program's block
    pool = torch.randn(blocks, 2, conv_dim, W, generator=g).to(DEV)
    conv = pool[:, 0]
    x = torch.randn(n, conv_dim, generator=g).to(torch.bfloat16).to(DEV)
    weight, bias = torch.randn(conv_dim, 1, W + 1, generator=g).to(DEV), torch.randn(conv_dim, generator=g).to(DEV)
    reads, writes, keep, valid = _rows()
    before, other_slot = conv.clone(), pool[:, 1].clone()
    window = torch.cat([before[reads] * keep[:, None, None], x.float().unsqueeze(-1)], dim=-1)
    ref = F.silu((window * weight.squeeze(1)).sum(-1) + bias)
    out = conv_decode(conv, reads, writes, keep, valid, x, weight, bias)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for row in range(3):
        assert torch.equal(conv[writes[row]], window[row, :, 1:])
    for untouched in (0, 1, 4, 5):
        assert torch.equal(conv[untouched], before[untouched])
    assert torch.equal(pool[:, 1], other_slot)


def test_gated_rms_norm_matches_the_torch_form():
    g = torch.Generator().manual_seed(2)
    T, I, groups, eps = 5, 96, 3, 1e-5
    y = torch.randn(T, I, generator=g).to(DEV)
    z = torch.randn(T, 2 * I, generator=g).to(torch.bfloat16).to(DEV)[:, :I]  # a view of a wider projection
    w = torch.randn(I, generator=g).to(DEV)
    v = (y * F.silu(z.float())).view(T, groups, -1)
    ref = w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).view(T, I)
    assert torch.allclose(gated_rms_norm(y, z, w, groups, eps, torch.float32), ref, atol=1e-5, rtol=1e-5)
    out = gated_rms_norm(y, z, w, groups, eps, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()  # one rounding to bf16
