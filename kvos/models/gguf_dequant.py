"""GGUF tensors to float32 with torch: one vectorised pass per tensor on all of torch's threads
for the block formats of the packaged models (Q4_1, Q8_0); gguf's own numpy code for the rest.

Results equal gguf's ``gguf.quants.dequantize`` bit for bit: the same float32 operations in the
same order (scale times quant, then plus the minimum), and float32 multiply and add round the
same everywhere. gguf applies its formula over small groups of rows, which took 2.2 s of
every load of the default model on the 2-core VM."""
from __future__ import annotations

import warnings

import numpy as np
import torch


def rows_of(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    """``raw`` (uint8, read-only memmap allowed) as ``[n_blocks, block_bytes]``, no copy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": only ever read
        return torch.frombuffer(np.ascontiguousarray(raw).data, dtype=torch.uint8).view(-1, block_bytes)


def to_float32(cols: torch.Tensor) -> torch.Tensor:
    """Two bytes per row as the row's float16 value, widened to float32: ``[n, 1]``."""
    return cols.contiguous().view(torch.float16).float()


def _q4_1(raw: np.ndarray) -> torch.Tensor:
    """Blocks of 32: float16 scale d, float16 minimum m, 16 bytes holding quants 0-15 in their
    low nibbles and 16-31 in their high ones; value = d * q + m."""
    b = rows_of(raw, 20)
    q = b[:, 4:]
    q = torch.cat([q & 15, q >> 4], dim=1).float()
    return q.mul_(to_float32(b[:, :2])).add_(to_float32(b[:, 2:4]))


def _q8_0(raw: np.ndarray) -> torch.Tensor:
    """Blocks of 32: float16 scale d, 32 signed bytes q; value = d * q."""
    b = rows_of(raw, 34)
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(to_float32(b[:, :2]))


_FAST = {"Q4_1": _q4_1, "Q8_0": _q8_0}


def dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    """``raw`` of GGML type ``qtype`` (a ``gguf.GGMLQuantizationType``) as a float32 array of the
    tensor's shape, as ``gguf.quants.dequantize`` returns it."""
    fast = _FAST.get(qtype.name)
    if fast is None:
        from gguf.quants import dequantize as reference

        return np.array(reference(raw, qtype), dtype=np.float32)
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[qtype]
    shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block)
    return fast(raw).reshape(shape).numpy()
