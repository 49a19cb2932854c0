"""The decoder's small float32 operations on the CPU (``elementwise.c``); the torch versions
in ``kvos.models.ops`` are their definition."""
from __future__ import annotations

import torch

from kvos.kernels.cpu.build import library


def applies(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors, and the kernels built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """``ops.rms_norm`` over the last dimension of x ``[..., dim]``: the normalised rows, and
    with ``residual`` also ``x + residual`` (a new tensor). Needs ``applies(x, weight)``."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(x2)
    res_out = None
    if residual is not None:
        res = residual.reshape(-1, dim).contiguous()
        res_out = torch.empty_like(x2)
    library().rms_norm(x2.data_ptr(), 0 if residual is None else res.data_ptr(),
                       0 if res_out is None else res_out.data_ptr(), weight.contiguous().data_ptr(), eps,
                       out.data_ptr(), x2.shape[0], dim, torch.get_num_threads())
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        x = x.contiguous()
    out = torch.empty(t, heads, dim, dtype=x.dtype)
    library().rotary(x.data_ptr(), t, heads, dim, x.stride(0), positions.data_ptr(), cos.data_ptr(),
                     sin.data_ptr(), out.data_ptr())
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.rotary`` (new tensors; q ``[T, H, D]``, k ``[T, KVH, D]`` may be row-strided views).
    Every position must index a row of the contiguous float32 ``cos``/``sin`` tables (the
    kernel reads them unchecked). Needs ``applies(q, k, cos, sin)``."""
    positions = positions.to(torch.int64).contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    return _rotate(q, positions, cos, sin), _rotate(k, positions, cos, sin)
