"""The fused Mamba2 decode kernel against the mixer's torch form: outputs and the states it
writes within 1e-5 (float32, summation order), in-place and cross-block updates, a sequence
starting from zeros, and padding rows that write nothing."""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import (  # first: before triton loads
    CUDA,
    skip_unless_interpreted,
)

pytest.importorskip("triton")

from kvos.kernels.mamba_update import _ssm_decode_kernel, ssm_decode  # noqa: E402

skip_unless_interpreted(_ssm_decode_kernel)
pytestmark = pytest.mark.gpu


def test_ssm_decode_matches_the_torch_form():
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(0)
    n, H, P, N, blocks = 4, 3, 12, 16, 7
    pool = torch.randn(blocks, 2, H, P, N, generator=g).to(dev)  # a page-major pool: 2 slots per block
    ssm = pool[:, 1]
    x, dt = torch.randn(n, H, P, generator=g).to(dev), torch.rand(n, H, generator=g).to(dev)
    A, D = -torch.rand(H, generator=g).to(dev), torch.randn(H, generator=g).to(dev)
    B, C = torch.randn(n, H, N, generator=g).to(dev), torch.randn(n, H, N, generator=g).to(dev)
    reads = torch.tensor([2, 0, 4, 5], device=dev)
    writes = torch.tensor([2, 3, 6, 0], device=dev)  # in place; from zeros; to the next block; padding
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0], device=dev)
    valid = torch.tensor([True, True, True, False], device=dev)
    before, other_slot = ssm.clone(), pool[:, 0].clone()
    h = before[reads] * (torch.exp(dt * A) * keep[:, None])[:, :, None, None] + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
    ref = torch.einsum("nhpk,nhk->nhp", h, C) + D[:, None] * x
    y = ssm_decode(ssm, reads, writes, keep, valid, x, dt, A, B, C, D)
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    for row in range(3):
        assert torch.allclose(ssm[writes[row]], h[row], atol=1e-5, rtol=1e-5)
    for untouched in (0, 1, 4, 5):
        assert torch.equal(ssm[untouched], before[untouched])
    assert torch.equal(pool[:, 0], other_slot)  # the other layer's slot of each page
