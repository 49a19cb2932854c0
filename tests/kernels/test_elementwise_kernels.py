"""The fused elementwise Triton kernels against the torch definitions in ``kvos.models.ops``.

Rotary and the residual sum are bit-exact in every dtype. RMSNorm and SiLU-and-mul: float32
within 1e-6 relative (reduction order, rsqrt/exp implementations); bf16/fp16 with every element
within 2 units in the last place of the reference and at most 1% of them (or 2) not bit-exact.
Under the CPU interpreter bf16 is only checked within 4 ulps (of the operands' magnitude for
rotary, whose sum may cancel): the interpreter converts float32 to bf16 by truncation, not
round-to-nearest-even.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import CUDA  # first: before triton loads

pytest.importorskip("triton")

from kvos.kernels.elementwise import (  # noqa: E402
    gelu_tanh_and_mul,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from kvos.models import ops  # noqa: E402
from kvos.models.config import ModelConfig  # noqa: E402
from kvos.models.llama import RotaryEmbedding  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F32 = torch.float32
# The interpreter runs each program in Python, so on CPU T=256 is kept to cases with few programs.
NORM_CASES = [(t, n, dt) for t in (1, 3, 17, 256) for n in (64, 576, 4096, 8192) for dt in DTYPES
              if CUDA or (n < 8192 and (t < 256 or n == 64))]
SILU_CASES = [(t, i, dt) for t in (1, 3, 17, 256) for i in (64, 576, 4096, 14336) for dt in DTYPES
              if CUDA or (i < 14336 and (t < 256 or (i == 64 and dt == F32)))]
ROPE_CASES = [(*shape, dt) for shape in [(1, 32, 8, 128), (3, 4, 2, 64), (17, 6, 3, 96), (256, 8, 2, 128),
                                         (5, 2, 1, 256)]
              for dt in DTYPES if CUDA or shape[0] < 256 or dt == F32]


def case_id(value) -> str:
    return str(value).removeprefix("torch.")


@pytest.fixture
def torch_ops(monkeypatch):
    """``kvos.models.ops`` forced onto its torch path (the numerical definition)."""
    monkeypatch.setattr(ops, "use_kernels", lambda x: False)
    return ops


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The module docstring's tolerance for ref's dtype."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30)
        return
    eps = torch.finfo(ref.dtype).eps
    ulps = 2 if CUDA or ref.dtype == torch.float16 else 4
    diff = (out.float() - ref.float()).abs()
    bound = ulps * eps * ref.float().abs().clamp_min(torch.finfo(ref.dtype).tiny)
    assert (diff <= bound).all(), f"max diff {diff.max().item()} beyond {ulps} ulps"
    if ulps == 2:
        assert (out != ref).sum().item() <= max(2, ref.numel() // 100)


def assert_exact(out: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> None:
    """Bit-exact, except under the interpreter's truncating bf16 conversion: there within 4 ulps
    of |ref| + scale (the operands' magnitude, where the result may cancel)."""
    if ref.dtype == torch.bfloat16 and not CUDA:
        diff = (out.float() - ref.float()).abs()
        assert (diff <= 4 * torch.finfo(ref.dtype).eps * (ref.float().abs() + scale)).all()
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("t,n,dtype", NORM_CASES, ids=case_id)
def test_rms_norm(torch_ops, t, n, dtype):
    x = randn(t, n, dtype=dtype, scale=3.0, seed=1)
    w = randn(n, dtype=dtype, seed=2).mul_(0.1).add_(1.0)
    ref = torch_ops.rms_norm(x, w, 1e-5)
    out = nan_like(x)
    assert rms_norm(x, w, 1e-5, out=out) is out
    assert_matches(out, ref)


@pytest.mark.parametrize("t,n,dtype", NORM_CASES, ids=case_id)
def test_rms_norm_residual(torch_ops, t, n, dtype):
    x = randn(t, n, dtype=dtype, seed=3)
    res = randn(t, n, dtype=dtype, scale=2.0, seed=4)
    w = randn(n, dtype=dtype, seed=5).mul_(0.1).add_(1.0)
    ref, ref_res = torch_ops.rms_norm(x, w, 1e-6, res)
    out, res_out = nan_like(x), nan_like(x)
    got = rms_norm(x, w, 1e-6, res, out=out, residual_out=res_out)
    assert got[0] is out and got[1] is res_out
    assert_exact(res_out, ref_res)
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=case_id)
@pytest.mark.parametrize("shape", [(3, 640), (17, 4, 256)], ids=str)
def test_gemma_rms_norm_weight_first(torch_ops, shape, dtype):
    """Gemma's norm (float32 ``1 + w`` multiplied before the one rounding), plain and per head,
    with and without the residual, against ``ops.gemma_rms_norm``'s torch path."""
    x = randn(*shape, dtype=dtype, scale=3.0, seed=6)
    w = randn(shape[-1], seed=7).mul_(0.2).add_(1.0)  # float32, as Gemma keeps it
    assert_matches(rms_norm(x, w, 1e-6, weight_first=True), torch_ops.gemma_rms_norm(x, w, 1e-6))
    res = randn(*shape, dtype=dtype, seed=8)
    out, res_out = rms_norm(x, w, 1e-6, res, weight_first=True)
    ref, ref_res = torch_ops.gemma_rms_norm(x, w, 1e-6, res)
    assert_exact(res_out, ref_res)
    assert_matches(out, ref)


def test_rms_norm_allocates_and_aliases(torch_ops):
    """Fresh contiguous outputs by default; in place when the outputs are the inputs."""
    x = randn(5, 80, 96, seed=6)[:, 7:71, :]  # non-contiguous [T, H, N]
    w = randn(96, seed=7)
    ref = torch_ops.rms_norm(x, w, 1e-5)
    out = rms_norm(x, w, 1e-5)
    assert out.is_contiguous()
    assert_matches(out, ref)
    x2, res = randn(9, 576, seed=8), randn(9, 576, seed=9)
    ref, ref_res = torch_ops.rms_norm(x2, w.new_ones(576), 1e-5, res)
    out, new_res = rms_norm(x2, w.new_ones(576), 1e-5, res, out=x2, residual_out=res)
    assert out is x2 and new_res is res
    assert_exact(res, ref_res)
    assert_matches(x2, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 17])
def test_rms_norm_per_head_view(torch_ops, t, dtype):
    """Qwen3's q/k norm on head views of a fused qkv output, written back in place."""
    heads, kv_heads, d = 8, 2, 128
    qkv = randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, scale=2.0, seed=10)
    q = qkv[:, :heads * d].view(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    w = randn(d, dtype=dtype, seed=11).mul_(0.1).add_(1.0)
    ref_q, ref_k = torch_ops.rms_norm(q, w, 1e-6), torch_ops.rms_norm(k, w, 1e-6)
    v = qkv[:, (heads + kv_heads) * d:].clone()
    assert_matches(rms_norm(q, w, 1e-6), ref_q)
    rms_norm(k, w, 1e-6, out=k)
    assert_matches(k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v)


def rope_tables(head_dim: int, scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ModelConfig(arch="llama", hidden_size=head_dim * 4, num_layers=1, num_heads=4, num_kv_heads=4,
                      head_dim=head_dim, intermediate_size=64, vocab_size=16, rope_theta=500000.0,
                      rope_scaling=scaling, max_position_embeddings=8192)
    rope = RotaryEmbedding(cfg, DEVICE)
    return rope.cos, rope.sin


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("t,heads,kv_heads,d,dtype", ROPE_CASES, ids=case_id)
def test_rotary_embedding(torch_ops, t, heads, kv_heads, d, dtype):
    """In place on the q/k views of a fused qkv output; v is untouched."""
    cos, sin = rope_tables(d, LLAMA3 if d == 128 else None)
    qkv = randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, scale=2.0, seed=12)
    q = qkv[:, :heads * d].view(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].clone()
    g = torch.Generator().manual_seed(13)
    positions = torch.randint(0, cos.shape[0], (t,), generator=g)
    positions = positions.to(DEVICE, torch.int32 if t % 2 else torch.int64)  # both index types
    ref_q, ref_k = torch_ops.rotary(positions, q, k, cos, sin)
    out_q, out_k = rotary_embedding(positions, q, k, cos, sin)
    assert out_q is q and out_k is k
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v)
    scale = qkv.float().abs().max().item()
    assert_exact(q, ref_q, scale)
    assert_exact(k, ref_k, scale)


@pytest.mark.parametrize("t,inter,dtype", SILU_CASES, ids=case_id)
def test_silu_and_mul(torch_ops, t, inter, dtype):
    """A row-strided [gate | up] view, as a slice of a wider buffer."""
    x = randn(t, 2 * inter + 32, dtype=dtype, scale=3.0, seed=14)[:, 16:16 + 2 * inter]
    ref = torch_ops.silu_and_mul(x)
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    assert_matches(out, ref)
    assert_matches(silu_and_mul(x), ref)


def assert_gelu_matches(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """GELU(tanh)-and-mul: the module docstring's tolerance, plus what tanh's last bits (an
    absolute error ~2^-22 where 1 + tanh cancels) and one flip of the rounded GELU value can
    move: |up| * (2^-22 |gate| + ulp(gelu)) (bf16/fp16 only for the latter), with ulps no
    smaller than a subnormal's."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    gate, up = x.float().chunk(2, dim=-1)
    eps = torch.finfo(ref.dtype).eps
    gelu = torch.nn.functional.gelu(gate, approximate="tanh").abs()
    slack = up.abs() * (2.0 ** -22 * gate.abs() + (0.0 if ref.dtype == F32 else eps * gelu))
    ulps = 1e-6 / eps if ref.dtype == F32 else (2 if CUDA or ref.dtype == torch.float16 else 4)
    diff = (out.float() - ref.float()).abs()
    spacing = torch.finfo(ref.dtype).tiny * eps  # a subnormal ulp (fp16's tiny outputs)
    bound = ulps * eps * ref.float().abs() + slack + (ulps + up.abs()) * spacing
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item()}"
    if CUDA and ref.dtype != F32:
        assert (out != ref).sum().item() <= max(2, ref.numel() // 100)


@pytest.mark.parametrize("t,inter,dtype", SILU_CASES, ids=case_id)
def test_gelu_tanh_and_mul(torch_ops, t, inter, dtype):
    """Gemma's gated MLP activation, on a row-strided [gate | up] view."""
    x = randn(t, 2 * inter + 32, dtype=dtype, scale=3.0, seed=15)[:, 16:16 + 2 * inter]
    ref = torch_ops.gelu_tanh_and_mul(x)
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=DEVICE)
    assert gelu_tanh_and_mul(x, out=out) is out
    assert_gelu_matches(out, ref, x)
    assert_gelu_matches(gelu_tanh_and_mul(x), ref, x)
