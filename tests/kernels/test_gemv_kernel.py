"""The one-row weight product (``kvos.kernels.gemv``) against float64 ``act(x) @ W^T (+ bias)``.

Each output is within one unit in the last place of the float64 result rounded to the output
dtype (two under the CPU interpreter, which rounds float32 to bf16 by truncation), plus the
float32 accumulation's own error bound (K * 2^-24 * sum |x| |w|). Cases cover K not a multiple
of the tile, N not a multiple of the column block, a bias, a strided row, the gated activations
read as the product goes (equal to the elementwise kernels' output multiplied, exactly), and
the engine's ``ops.Linear`` / ``ops.GatedLinear`` taking the kernel on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import (  # first: before triton loads
    CUDA,
    skip_unless_interpreted,
)

pytest.importorskip("triton")

from kvos.kernels import gemv  # noqa: E402
from kvos.kernels.elementwise import gelu_tanh_and_mul, silu_and_mul  # noqa: E402
from kvos.models import ops  # noqa: E402

skip_unless_interpreted(gemv._gemv_kernel)
pytestmark = pytest.mark.gpu

DEVICE = "cuda" if CUDA else "cpu"
SHAPES = [(37, 700), (64, 512), (24, 1024)] + ([(6144, 4096), (4096, 14336)] if CUDA else [])
CASES = [(n, k, dt, bias) for n, k in SHAPES for dt in (torch.bfloat16, torch.float16) for bias in (False, True)
         if CUDA or dt == torch.bfloat16 or not bias]
ACTS = {"silu": (silu_and_mul, lambda g: torch.nn.functional.silu(g)),
        "gelu_tanh": (gelu_tanh_and_mul, lambda g: torch.nn.functional.gelu(g, approximate="tanh"))}


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """out against float64 ``x @ w^T + b`` within the module docstring's bound."""
    ref = x.double() @ w.double().t()
    if b is not None:
        ref += b.double()
    eps = torch.finfo(out.dtype).eps
    ulps = 1 if CUDA else 2
    bound = ulps * eps * ref.abs() + x.shape[1] * 2 ** -24 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    err = (out.double() - ref).abs()
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert (err <= bound).all(), f"max error {err.max().item()}"


def data(n: int, k: int, dtype, bias: bool, seed: int, width: int | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, width or k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("n,k,dtype,bias", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_matches_float64(n, k, dtype, bias):
    x, w, b = data(n, k, dtype, bias, n + k)
    assert gemv.applies(x, w)
    check(gemv.matmul(x, w, b), x, w, b)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("n,k", [(40, 700), (64, 512)] + ([(4096, 14336)] if CUDA else []))
def test_gated_activation_read_as_the_product_goes(act, n, k):
    """``matmul(x, w, activation=act)`` over ``x = [gate | up]`` equals ``matmul`` of the
    elementwise kernel's ``act(gate) * up`` exactly, and torch's definition within the bound."""
    kernel, torch_act = ACTS[act]
    x, w, _ = data(n, k, torch.bfloat16, False, 3 * n + k, width=2 * k)
    assert gemv.applies(x, w, act) and not gemv.applies(x, w)
    fused = gemv.matmul(x, w, activation=act)
    assert torch.equal(fused, gemv.matmul(kernel(x), w))
    gate, up = x.chunk(2, dim=-1)
    check(fused, (torch_act(gate.float()).to(x.dtype) * up).to(x.dtype) if CUDA else kernel(x), w, None)


def test_strided_row_and_the_applies_limits():
    """A row of a wider tensor (a view) multiplies as itself; float32, 3-D inputs, two rows, a
    transposed weight and an unknown activation are refused."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(1, 96, generator=g).to(DEVICE, torch.bfloat16)
    x = wide[:, 16:80]
    w = (torch.randn(40, 64, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    check(gemv.matmul(x, w), x, w, None)
    assert not gemv.applies(x.float(), w.float())
    assert not gemv.applies(x[None], w)
    assert not gemv.applies(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    assert not gemv.applies(x, w.t().contiguous().t())
    assert not gemv.applies(torch.zeros(1, 128, dtype=torch.bfloat16), w, "relu")


@pytest.mark.skipif(not CUDA, reason="ops.Linear takes the kernel only on a CUDA GPU")
def test_linear_layers_take_the_kernel_for_one_row(monkeypatch):
    """On a GPU one row goes through ``gemv.matmul`` (within the bound above), two through cuBLAS;
    ``GatedLinear`` hands its activation to the kernel."""
    calls = []
    real = gemv.matmul
    monkeypatch.setattr(gemv, "matmul", lambda x, *a, **kw: calls.append((x.shape[0], kw.get("activation")))
                        or real(x, *a, **kw))
    lin = ops.Linear(512, 96, bias=True).to("cuda", torch.bfloat16)
    gated = ops.GatedLinear(256, 96, ops.silu_and_mul).to("cuda", torch.bfloat16)
    for m in (1, 2):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        check(lin(x), x, lin.weight, lin.bias)
        out = gated(x)
        two_steps = real(silu_and_mul(x), gated.weight) if m == 1 else torch.nn.functional.linear(silu_and_mul(x),
                                                                                                   gated.weight)
        assert torch.equal(out, two_steps)
    assert calls == [(1, None), (1, "silu")]
