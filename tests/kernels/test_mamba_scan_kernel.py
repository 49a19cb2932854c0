"""The chunked prefill scan against the mixer's torch form (``ssd_chunk``, run sequence by
sequence between save points): outputs and the states written at save points within 1e-4,
over several sequences of one step (one from zeros, one continuing inside its read block, one
reading another block; the convolution likewise, its windows saved at save points, one of them
into the block it read), chunks cut both at the chunk size and at save points and run in
several tiles, heads sharing
their group's B and C, and blocks no save names left untouched."""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import (  # first: before triton loads
    CUDA,
    skip_unless_interpreted,
)

pytest.importorskip("triton")

from kvos.kernels.mamba_scan import (  # noqa: E402
    _chunk_cb_kernel,
    _chunk_scan_kernel,
    _chunk_state_kernel,
    _conv_prefill_kernel,
    _conv_save_kernel,
    _prefill_dt_kernel,
    _state_pass_kernel,
    chunked_scan,
    conv_prefill,
    conv_rows,
    prefill_dt,
    scan_chunks,
)
from kvos.models.mamba import ssd_chunk  # noqa: E402
from kvos.models.state import SeqStates  # noqa: E402

skip_unless_interpreted(_chunk_cb_kernel, _chunk_state_kernel, _state_pass_kernel, _chunk_scan_kernel,
                        _conv_prefill_kernel, _conv_save_kernel, _prefill_dt_kernel)
pytestmark = pytest.mark.gpu


def test_chunked_scan_matches_the_torch_form():
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(0)
    H, G, P, N, blocks, chunk, tile = 4, 2, 12, 16, 9, 32, 16
    seqs = [SeqStates(0, 37, -1, [(8, 1), (24, 2), (37, 4)]),   # from zeros; saves inside chunks
            SeqStates(37, 5, 3, [(5, 3)]),                       # continues inside its read block
            SeqStates(42, 80, 5, [(20, 6), (80, 7)])]            # reads one block, saves two others
    T = 122
    x, dt = torch.randn(T, H, P, generator=g), torch.rand(T, H, generator=g) * 0.5
    A, D = -torch.rand(H, generator=g) - 0.1, torch.randn(H, generator=g)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    pool = torch.randn(blocks, 2, H, P, N, generator=g)  # page-major: 2 layer slots per block
    ssm = pool[:, 1]
    before = ssm.clone()
    ref_y, ref_states = torch.empty(T, H, P), {}
    Bh, Ch = B.repeat_interleave(H // G, dim=1), C.repeat_interleave(H // G, dim=1)
    for q in seqs:
        h = before[q.read_block].clone() if q.read_block >= 0 else torch.zeros(H, P, N)
        a = 0
        for b, block in q.saves:
            r = slice(q.row + a, q.row + b)
            out, h = ssd_chunk(x[r], dt[r], A, Bh[r], Ch[r], h)
            ref_y[r] = out + D[:, None] * x[r]
            ref_states[block] = h
            a = b
    pool_d = pool.to(dev)
    y = torch.empty(T, H, P, device=dev)
    chunks = scan_chunks(seqs, 0, torch.device(dev), chunk=chunk)
    assert chunks.num_chunks == 3 + 1 + 3  # 37: 8|24|37; 5; 80: 20|52|80 (a chunk ends at each save)
    chunked_scan(chunks, x.to(dev), dt.to(dev), A.to(dev), B.to(dev), C.to(dev), D.to(dev), pool_d[:, 1], y,
                 exact=True, chunk=chunk, tile=tile)
    assert torch.allclose(y.cpu(), ref_y, atol=1e-4, rtol=1e-4)
    got = pool_d[:, 1].cpu()
    for block in range(blocks):
        if block in ref_states:
            assert torch.allclose(got[block], ref_states[block], atol=1e-4, rtol=1e-4), block
        else:
            assert torch.equal(got[block], before[block]), block
    assert torch.equal(pool_d[:, 0].cpu(), pool[:, 0])  # the other layer's slot of each page


@pytest.mark.skipif(not CUDA, reason="the triton interpreter's bfloat16 products are wrong (garbage even "
                                       "on float32 inputs), so the bfloat16 path is checked on a GPU only")
def test_bfloat16_inputs_scan_as_their_float32_values():
    """Unless exact, the products round x, B, C and the state entering each chunk to bfloat16:
    x, B and C given in bfloat16 (the convolution's output on bf16 models) give the result of
    their float32 values (up to the order of float32 sums), within bfloat16's rounding of the
    float32 torch form."""
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    H, G, P, N, chunk, tile = 4, 2, 16, 16, 32, 16
    seqs = [SeqStates(0, 45, -1, [(16, 1), (45, 2)]), SeqStates(45, 20, 4, [(20, 3)])]
    T = 65
    x, dt = torch.randn(T, H, P, generator=g).bfloat16(), torch.rand(T, H, generator=g) * 0.5
    A, D = -torch.rand(H, generator=g) - 0.1, torch.randn(H, generator=g)
    B, C = torch.randn(T, G, N, generator=g).bfloat16(), torch.randn(T, G, N, generator=g).bfloat16()
    ssm0 = torch.randn(5, H, P, N, generator=g)
    outs = []
    for dtype in (torch.bfloat16, torch.float32):
        ssm, y = ssm0.to(dev), torch.empty(T, H, P, device=dev)
        chunked_scan(scan_chunks(seqs, 0, torch.device(dev), chunk=chunk), x.to(dev, dtype), dt.to(dev),
                     A.to(dev), B.to(dev, dtype), C.to(dev, dtype), D.to(dev), ssm, y, chunk=chunk, tile=tile)
        outs.append((y.cpu(), ssm.cpu()))
    for got, want in zip(outs[0], outs[1]):  # the products' code differs: equal up to float32 sums
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()
    ref = torch.empty(T, H, P)
    Bh, Ch = B.float().repeat_interleave(H // G, dim=1), C.float().repeat_interleave(H // G, dim=1)
    for q in seqs:
        h = ssm0[q.read_block].clone() if q.read_block >= 0 else torch.zeros(H, P, N)
        a = 0
        for b, block in q.saves:
            r = slice(q.row + a, q.row + b)
            out, h = ssd_chunk(x[r].float(), dt[r], A, Bh[r], Ch[r], h)
            ref[r] = out + D[:, None] * x[r].float()
            assert (outs[0][1][block] - h).abs().max() < 2e-2 * h.abs().max(), block
            a = b
    assert (outs[0][0] - ref).abs().max() < 2e-2 * ref.abs().max()


def test_conv_prefill_matches_the_torch_form():
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(1)
    conv_dim, W, blocks = 200, 3, 9
    seqs = [SeqStates(0, 2, -1, [(2, 1)]),                       # shorter than the window, from zeros
            SeqStates(2, 5, 3, [(1, 3), (5, 4)]),                 # saves into its read block after one token
            SeqStates(7, 30, 5, [(20, 6), (30, 7)])]
    T = 37
    x = torch.randn(T, 2 * conv_dim, generator=g).to(torch.bfloat16)[:, :conv_dim]  # a view of a projection
    weight, bias = torch.randn(conv_dim, 1, W + 1, generator=g), torch.randn(conv_dim, generator=g)
    pool = torch.randn(blocks, 2, conv_dim, W, generator=g)
    fresh = pool.clone()  # pool itself is written (on the CPU, pool.to(dev) is pool)
    before = pool[:, 0].clone()
    ref, windows = torch.empty(T, conv_dim), {}
    for q in seqs:
        prev = before[q.read_block] if q.read_block >= 0 else torch.zeros(conv_dim, W)
        full = torch.cat([prev, x[q.row: q.row + q.num_tokens].float().t()], dim=1)
        out = torch.nn.functional.conv1d(full.unsqueeze(0), weight, bias, groups=conv_dim)[0].t()
        ref[q.row: q.row + q.num_tokens] = torch.nn.functional.silu(out)
        for b, block in q.saves:
            windows[block] = full[:, b: b + W]
    pool_d = pool.to(dev)
    got = conv_prefill(conv_rows(seqs, 0, torch.device(dev)), x.to(dev), pool_d[:, 0], weight.to(dev), bias.to(dev))
    assert torch.allclose(got.cpu(), ref, atol=1e-5, rtol=1e-5)
    half = conv_prefill(conv_rows(seqs, 0, torch.device(dev)), x.to(dev), fresh.to(dev)[:, 0], weight.to(dev),
                        bias.to(dev), torch.bfloat16)  # the scan's input on bf16 models: the same sums, rounded once
    assert half.dtype == torch.bfloat16
    if CUDA:
        assert torch.equal(half, got.to(torch.bfloat16))
    else:  # the interpreter rounds to bfloat16 toward zero
        assert torch.allclose(half.float(), got, rtol=2 ** -6, atol=0)
    for block in range(blocks):
        assert torch.equal(pool_d[block, 0].cpu(), windows.get(block, before[block])), block
    assert torch.equal(pool_d[:, 1].cpu(), pool[:, 1])


def test_prefill_dt_is_the_mixers_torch_form():
    """One kernel for ``clamp(softplus(dt_raw + dt_bias))`` on a bf16 view of the projection
    (row stride of the projection): torch's values, past softplus' threshold (20) and far below 0,
    inside and outside the clamp."""
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(4)
    T, H = 37, 24
    proj = (torch.randn(T, 3 * H, generator=g) * 12).to(torch.bfloat16)
    raw, bias = proj[:, H: 2 * H], torch.randn(H, generator=g)
    for lo, hi in ((0.0, float("inf")), (1e-3, 5.0)):
        want = torch.nn.functional.softplus(raw.float() + bias).clamp(lo, hi)
        got = prefill_dt(raw.to(dev), bias.to(dev), (lo, hi)).cpu()
        assert got.dtype == torch.float32 and got.shape == (T, H)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (raw.float() + bias).max() > 20 and (raw.float() + bias).min() < -20
