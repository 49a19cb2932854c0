"""Products with block-quantized weights on the CPU (``quant_matmul.c``) and their float32
definition.

A ``BlockQuantWeight`` holds ``W [N, K]`` in blocks of 32 along K: ``u4`` (``w = q * D + M``,
q 0..15, two per byte) or ``i8`` (``w = q * D``, q a signed byte). ``dequantize`` is the
numerical definition. ``matmul`` with 2 or more rows of x uses exactly those float32 weights
(only the order of the sum over K differs from ``x @ dequantize(w).T``); with one row it
multiplies the quants with x's two 16-bit integer parts per value in integers and applies the
scales per block: the same sum, within float32 rounding (``quant_matmul.c``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvos.kernels.cpu.build import library

BLOCK = 32


@dataclass(frozen=True)
class BlockQuantWeight:
    """``q``: ``[N, K/2]`` uint8 (u4) or ``[N, K]`` int8 (i8); ``d`` (and ``m`` for u4):
    ``[N, K/32]`` float32. All contiguous, on the CPU."""

    form: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.form not in ("u4", "i8"):
            raise ValueError(f"weight form {self.form!r} is neither 'u4' nor 'i8'")
        n, nb = self.d.shape
        per_row = nb * (BLOCK // 2 if self.form == "u4" else BLOCK)
        if tuple(self.q.shape) != (n, per_row) or (self.form == "u4") != (self.m is not None):
            raise ValueError(f"{self.form} weight: quants {tuple(self.q.shape)} do not match "
                             f"scales {tuple(self.d.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def rows(self, index: torch.Tensor | slice) -> "BlockQuantWeight":
        """The rows ``index`` of W (a permutation or a slice), as a new weight."""
        pick = (lambda t: t[index].contiguous())
        return BlockQuantWeight(self.form, pick(self.q), pick(self.d),
                                None if self.m is None else pick(self.m))

    @staticmethod
    def cat(parts: list["BlockQuantWeight"]) -> "BlockQuantWeight":
        """Rows of ``parts`` stacked (a fused projection); all of one form."""
        forms = {p.form for p in parts}
        if len(forms) != 1:
            raise ValueError(f"cannot stack weights of forms {sorted(forms)}")
        return BlockQuantWeight(parts[0].form, torch.cat([p.q for p in parts]),
                                torch.cat([p.d for p in parts]),
                                None if parts[0].m is None else torch.cat([p.m for p in parts]))


def _expand(w: BlockQuantWeight) -> torch.Tensor:
    """The quants as float32 ``[N, K/32, 32]``."""
    if w.form == "i8":
        return w.q.view(w.q.shape[0], -1, BLOCK).float()
    q = w.q.view(w.q.shape[0], -1, BLOCK // 2)
    return torch.cat([q & 15, q >> 4], dim=-1).float()


def dequantize(w: BlockQuantWeight) -> torch.Tensor:
    """W in float32 ``[N, K]``: per weight ``q * D`` then ``+ M`` (u4), rounded after each."""
    out = _expand(w).mul_(w.d.unsqueeze(-1))
    if w.m is not None:
        out.add_(w.m.unsqueeze(-1))
    return out.reshape(w.shape)


def kernels_available() -> bool:
    return library() is not None


def matmul(x: torch.Tensor, w: BlockQuantWeight) -> torch.Tensor:
    """``x @ W^T`` for float32 CPU ``x [M, K]``; needs ``kernels_available()``."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"quantized matmul: x must be float32 [M, {k}] on the CPU, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out
    threads = torch.get_num_threads()
    if w.form == "u4":
        lib.u4_matmul(x.data_ptr(), m, k, w.q.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), n,
                      out.data_ptr(), threads)
    else:
        lib.i8_matmul(x.data_ptr(), m, k, w.q.data_ptr(), w.d.data_ptr(), n, out.data_ptr(), threads)
    return out
