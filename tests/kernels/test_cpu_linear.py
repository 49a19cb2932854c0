"""``ops.Linear`` (the CPU path that multiplies ``W @ x^T`` for few rows) against
``torch.nn.functional.linear`` on the same weights: float32 within 1e-5 relative, for row counts
on both sides of the switch, with and without a bias, and the module's state dict unchanged."""
from __future__ import annotations

import pytest
import torch

from kvos.models import ops


@pytest.mark.parametrize("rows", [1, 2, 6, ops.FEW_ROWS, ops.FEW_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_torch_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    layer = ops.Linear(576, 960, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=g) / 24)
        if bias:
            layer.bias.copy_(torch.randn(960, generator=g))
    x = torch.randn(rows, 576, generator=g)
    with torch.no_grad():
        got = layer(x)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(layer.state_dict()) == ({"weight", "bias"} if bias else {"weight"})
