"""GGUF block formats as ``BlockQuantWeight``s that the CPU kernels multiply as stored.

Each converter keeps GGUF's blocks of 32 and returns weights whose ``dequantize`` equals
``gguf_dequant.dequantize`` of the same tensor bit for bit (tested per format):
- Q4_1: ``w = d * q + m`` (u4, the bytes as they are);
- Q4_K: ``w = (d * sc) * q - dmin * mn`` per sub-block of 32 (u4 with ``M = -(dmin * mn)``);
- Q8_0: ``w = d * q`` (i8);
- Q5_0: ``w = d * (q - 16)`` with the fifth bit from ``qh`` (i8).
Q6_K (sub-blocks of 16) and the other formats stay float32."""
from __future__ import annotations

import numpy as np
import torch

from kvos.kernels.cpu.quant_matmul import BlockQuantWeight
from kvos.models.gguf_dequant import rows_of, to_float32


def _q4_1(raw: np.ndarray, n: int) -> BlockQuantWeight:
    b = rows_of(raw, 20)
    return BlockQuantWeight("u4", b[:, 4:].reshape(n, -1).contiguous(),
                            to_float32(b[:, :2]).reshape(n, -1), to_float32(b[:, 2:4]).reshape(n, -1))


def _q8_0(raw: np.ndarray, n: int) -> BlockQuantWeight:
    b = rows_of(raw, 34)
    return BlockQuantWeight("i8", b[:, 2:].contiguous().view(torch.int8).reshape(n, -1),
                            to_float32(b[:, :2]).reshape(n, -1))


def _pack_u4(q: torch.Tensor) -> torch.Tensor:
    """Quants 0..15 ``[n, K]`` (uint8) in the u4 byte order: per block of 32, byte e holds
    element e in its low nibble and element e + 16 in its high one."""
    n = q.shape[0]
    b = q.view(n, -1, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, -1).contiguous()


def _q5_0(raw: np.ndarray, n: int) -> BlockQuantWeight:
    b = rows_of(raw, 22)
    qh = b[:, 2:6].contiguous().view(torch.int32)  # little-endian bit e: element e's fifth bit
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    qs = b[:, 6:]
    low = torch.cat([qs & 15, qs >> 4], dim=1).to(torch.int32)
    q = (low | (high << 4)) - 16
    return BlockQuantWeight("i8", q.to(torch.int8).reshape(n, -1), to_float32(b[:, :2]).reshape(n, -1))


def _q4_k(raw: np.ndarray, n: int) -> BlockQuantWeight:
    from gguf.quants import Q4_K

    b = rows_of(raw, 144)
    sc, mn = Q4_K.get_scale_min(b[:, 4:16].numpy())
    d = to_float32(b[:, :2]) * torch.from_numpy(sc.reshape(-1, 8).astype(np.float32))
    m = -(to_float32(b[:, 2:4]) * torch.from_numpy(mn.reshape(-1, 8).astype(np.float32)))
    qs = b[:, 16:].reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=2).reshape(n, -1)  # sub-block 2c: chunk c's low nibbles
    return BlockQuantWeight("u4", _pack_u4(q), d.reshape(n, -1).contiguous(), m.reshape(n, -1).contiguous())


CONVERTERS = {"Q4_1": _q4_1, "Q4_K": _q4_k, "Q8_0": _q8_0, "Q5_0": _q5_0}
"""GGML type names the CPU kernels take as stored."""


def block_weight(raw: np.ndarray, qtype) -> BlockQuantWeight | None:
    """A 2-D GGUF tensor of GGML type ``qtype`` (``gguf.GGMLQuantizationType``) in kernel form,
    or None for formats the kernels do not take."""
    convert = CONVERTERS.get(qtype.name)
    if convert is None or raw.ndim != 2:
        return None
    return convert(raw, raw.shape[0])
