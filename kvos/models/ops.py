"""The decoder's small fused operations, by device: Triton kernels on a CUDA GPU (when triton is
installed and ``KVOS_TRITON`` is not ``0``), plain torch elsewhere. The torch versions are the
numerical definition; the kernels are tested against them."""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from kvos.kernels.cpu import elementwise as cpu_kernels
from kvos.kernels.cpu.quant_matmul import BlockQuantWeight, kernels_available
from kvos.kernels.cpu.quant_matmul import matmul as quant_matmul


@functools.cache
def triton_enabled() -> bool:
    if os.environ.get("KVOS_TRITON", "1") == "0" or not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("triton") is not None


def use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_enabled()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * normalize(x)`` with the normalisation in float32; with ``residual``, first
    ``x = x + residual`` and return ``(normed, x)``."""
    if use_kernels(x):
        from kvos.kernels.elementwise import rms_norm as kernel

        return kernel(x, weight, eps, residual)
    if x.device.type == "cpu" and cpu_kernels.applies(x, weight, *(() if residual is None else (residual,))):
        return cpu_kernels.rms_norm(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    """``rms_norm`` in torch operations: the definition the kernels are tested against."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, x)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-interleaved (``rotate_half``) rotary embedding of q ``[T, H, D]`` and k ``[T, KVH, D]``;
    cos/sin are float32 ``[max_pos, D]`` tables."""
    if use_kernels(q):
        from kvos.kernels.elementwise import rotary_embedding

        return rotary_embedding(positions, q, k, cos, sin)
    if q.device.type == "cpu" and cpu_kernels.applies(q, k, cos, sin):
        return cpu_kernels.rotary(positions, q, k, cos, sin)
    return rotary_reference(positions, q, k, cos, sin)


def rotary_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary`` in torch operations: the definition the kernels are tested against."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of x = ``[gate | up]``."""
    if use_kernels(x):
        from kvos.kernels.elementwise import silu_and_mul as kernel

        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of x = ``[gate | up]`` (Gemma's gated MLP,
    transformers' ``gelu_pytorch_tanh``)."""
    if use_kernels(x):
        from kvos.kernels.elementwise import gelu_tanh_and_mul as kernel

        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm, ``(normalize(x) * weight)`` in float32 rounded once to x's dtype, where
    ``weight`` holds the effective ``1 + w`` (transformers' ``Gemma3RMSNorm`` computes
    ``1.0 + w.float()``); with ``residual``, first ``x = x + residual`` and return ``(normed, x)``.
    For float32 x this is exactly ``rms_norm`` (kernel included); other dtypes round only after
    the weight product (the kernel's ``weight_first`` mode on a GPU)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return rms_norm(x, weight, eps, residual)
    if use_kernels(x):
        from kvos.kernels.elementwise import rms_norm as kernel

        return kernel(x, weight, eps, residual, weight_first=True)
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


FEW_ROWS = 64
"""From 2 to this many rows, a float32 CPU linear layer multiplies ``W @ x^T`` (``Linear``)."""

BLOCK_WEIGHT_ROWS = 64
"""Up to this many rows, a CPU linear layer with block-quantized weights uses them (``Linear``)."""

ONE_ROW_KERNEL = True
"""A 16-bit linear layer on a GPU multiplies one row with ``kvos.kernels.gemv`` (one stream of
the weights) instead of cuBLAS (``Linear``, ``GatedLinear``)."""


class Linear(torch.nn.Linear):
    """``nn.Linear`` with two CPU paths for float32 inputs of few rows (decode steps):

    - ``blocks`` set (GGUF weights as stored, ``attach_blocks``) and the C kernels built: up to
      ``BLOCK_WEIGHT_ROWS`` rows multiply the block-quantized weights, whose float32 values equal
      ``weight`` exactly (a quarter to a seventh of its bytes read per step);
    - otherwise, 2 to ``FEW_ROWS`` rows compute ``(W @ x^T)^T``. MKL's sgemm for ``x @ W^T``
      repacks all of ``W`` on every call, which for a few rows costs more than the product: on
      the 2-core VM, SmolLM2's 113 MB output layer at 6 rows took 45 ms that way and 15 ms this
      way, a decoder layer's four products 2.9 and 2.1 ms.
    Other devices, dtypes and larger batches use ``nn.Linear``'s path on ``weight``."""

    blocks: BlockQuantWeight | None = None

    def attach_blocks(self, blocks: BlockQuantWeight) -> None:
        """Use ``blocks`` for few-row CPU products. Only valid when ``dequantize(blocks)`` equals
        ``weight`` (the caller's contract: both come from the same stored tensor)."""
        if tuple(blocks.shape) != tuple(self.weight.shape):
            raise ValueError(f"block weights {tuple(blocks.shape)} do not match the layer's "
                             f"{tuple(self.weight.shape)}")
        self.blocks = blocks

    def one_row_product(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor | None:
        """``kvos.kernels.gemv``'s product of one 16-bit row on a GPU (``activation``: x is
        ``[gate | up]``), or None where that kernel does not apply."""
        if ONE_ROW_KERNEL and x.dim() == 2 and x.shape[0] == 1 and use_kernels(x):
            from kvos.kernels import gemv

            if gemv.applies(x, self.weight, activation):
                return gemv.matmul(x, self.weight, self.bias, activation=activation)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
            out = self.one_row_product(x)
            return out if out is not None else super().forward(x)
        rows = x.shape[0]
        if self.blocks is not None and 0 < rows <= BLOCK_WEIGHT_ROWS and kernels_available():
            out = quant_matmul(x, self.blocks)
        elif 1 < rows <= FEW_ROWS:
            out = torch.mm(self.weight, x.t()).t().contiguous()
        else:
            return super().forward(x)
        return out if self.bias is None else out.add_(self.bias)


class GatedLinear(Linear):
    """A linear layer whose input is ``[gate | up]``: ``forward(x) = linear(act_and_mul(x))``
    (an MLP's down projection with its activation). ``act_and_mul`` is ``silu_and_mul`` or
    ``gelu_tanh_and_mul``; on a GPU one row runs as one kernel that applies the activation as it
    reads (the same values as the two steps, ``kvos.kernels.gemv``). Forward hooks see the
    output as for ``Linear``."""

    _FUSED = {silu_and_mul: "silu", gelu_tanh_and_mul: "gelu_tanh"}

    def __init__(self, in_features: int, out_features: int, act_and_mul, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.act_and_mul = act_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self._FUSED.get(self.act_and_mul)
        out = self.one_row_product(x, act) if act is not None else None
        return out if out is not None else super().forward(self.act_and_mul(x))
